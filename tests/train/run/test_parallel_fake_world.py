"""The paper's 2 nodes x 8 GPUs in one process (train/run/parallel.py): torch's fake process group (backend `fake`,
`FakeStore`) plays ranks of a world of 16 one after another, and for each the trainer's own code builds the FSDP2
mesh and shards the model, and Lightning's own conversion makes the state dict it hands DCP. Checked by hand
(node = rank // 8, shard index = rank % 8): the hybrid (replicate 2, shard 8) mesh and its groups; every parameter's
local shard, the rows torch.chunk gives (ceil(dim0 / 8) rows, the last shards short or empty), and the padded
storage FSDP2 keeps, which is what `posfreq plan` counts (train.run.memory.shard_numel); DCP's default save planner writes each
chunk of the two replicas' identical shards, and each replicated item, once, not twice.

Why: the gloo tests (test_parallel_fsdp.py) run 2 x 2 ranks in child processes for minutes; the mesh, the shard
shapes and the save plan of the real 16-rank layout need no communication, so they take seconds here.

What the fake backend allows, and what it does not:
- its collectives move no data (FSDP2's broadcasts, all-gathers and reduce-scatters are no-ops), so nothing here
  trains or compares values: shapes, groups and plans only;
- the paper's 1.3B model is sharded on the meta device (ranks 0, 7, 8, 15). Its state dict cannot be made as
  Lightning makes it (`cpu_offload=True` copies each shard to the CPU: "Cannot copy out of meta tensor"), and a real
  1.3B model per simulated rank is too big for seconds, so DCP's plan uses the same config with a small model of
  real CPU tensors (all 16 ranks: the global plan needs every rank's local plan). Every dimension of the 1.3B
  model divides by 8; the small one has short and empty shards (dim0 97, 20 and 10 over 8 ranks);
- one process playing several ranks is not a real run: DTensor caches its sharding propagation across meshes that
  compare equal, so without clearing that cache between ranks a later rank's parameters carried rank 0's mesh
  (coordinate (0, 0), and process groups of a destroyed world that no longer resolve). `fake_rank` clears it
  (torch.distributed.tensor.debug), and the tests check every parameter's mesh, coordinate and groups.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from posfreq.train.model.transformer import Transformer
from posfreq.train.run import memory, parallel
from posfreq.train.run.config import TrainConfig, config_from_dict
from posfreq.train.run.geometry import resolve_model_config
from posfreq.train.run.optim import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
NODES, DEVICES = 2, 8
WORLD = NODES * DEVICES
RANKS = (0, 7, 8, 15)  # each node's first and last rank
# dim0 over 8 ranks: vocab 97 -> 13 rows (the last rank 6), d_model 20 -> 3 (rank 6 2, rank 7 none),
# the KV projections' 10 -> 2 (ranks 5 to 7 none), ffn 40 -> 5 (even)
SMALL = {"d_model": 20, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 40, "vocab_size": 97}


def paper_config(out: Path, **model_overrides) -> TrainConfig:
    """configs/pretrain_2k.yaml on 2 nodes x 8 devices (`fsdp: auto`), on CPU and without wandb; the model's
    overrides if any."""
    raw = yaml.safe_load((CONFIGS / "pretrain_2k.yaml").read_text())
    raw.update(num_nodes=NODES, devices=DEVICES, accelerator="cpu", out=str(out))
    raw["logging"]["logger"] = "none"
    if model_overrides:
        raw["model"].update(preset="tiny-2l-128", overrides=model_overrides)
    return config_from_dict(raw)


@contextlib.contextmanager
def fake_rank(rank: int):
    """torch.distributed as rank `rank` of WORLD on the fake backend (no communication)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # importing fake_pg registers the "fake" backend (dist.Backend.register_backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()  # the module docstring: else the next rank gets this rank's meshes


def lightning_mesh(strategy):
    """The 1-D data-parallel mesh Lightning's ModelParallelStrategy builds in setup_environment, from the sizes
    build_fabric gave it; the trainer's parallelize function receives it."""
    from lightning.fabric.strategies.model_parallel import _setup_device_mesh

    return _setup_device_mesh(
        strategy._data_parallel_size, strategy._tensor_parallel_size, WORLD, torch.device("cpu")
    )


def describe(mesh) -> tuple:
    """(shape, dim names, ranks, this rank's coordinate, its shard group, its replicate group)."""
    return (
        tuple(mesh.shape),
        mesh.mesh_dim_names,
        mesh.mesh.tolist(),
        tuple(mesh.get_coordinate()),
        dist.get_process_group_ranks(mesh.get_group("shard")),
        dist.get_process_group_ranks(mesh.get_group("replicate")),
    )


def expected_mesh(rank: int) -> tuple:
    node, index = divmod(rank, DEVICES)
    return (
        (NODES, DEVICES),
        ("replicate", "shard"),
        [list(range(8)), list(range(8, 16))],
        (node, index),
        [DEVICES * node + i for i in range(DEVICES)],
        [index + DEVICES * n for n in range(NODES)],
    )


def rows_per_shard(dim0: int) -> int:
    return -(-dim0 // DEVICES)


def expected_rows(dim0: int, rank: int) -> int:
    """Rows of dim 0 on `rank` (torch.chunk: chunks of ceil(dim0 / 8), the last ones short or missing)."""
    per = rows_per_shard(dim0)
    return max(0, min(per, dim0 - (rank % DEVICES) * per))


def fsdp2_storage(model) -> dict[str, int]:
    """Elements of the sharded storage FSDP2 allocates for each parameter on this rank (padded to equal shards)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else []:
                found[names[id(param.sharded_param)]] = param._sharded_param_data.numel()
    return found


@dataclass
class RankView:
    """What one rank saw: Lightning's mesh, its parameters' meshes and placements, local shard shapes, FSDP2's
    storage, and (small model) DCP's local save plan."""

    rank: int
    lightning: tuple
    meshes: list
    placements: set
    local: dict
    storage: dict
    save_plan: object = None
    planner: object = None


def shard_rank(cfg: TrainConfig, rank: int, model: Transformer, save: Path | None) -> RankView:
    """Shard `model` on fake rank `rank` as the trainer does (build_fabric's parallelize function, then
    synchronize_replicas); with a `save` folder, DCP's local plan of what Fabric's save hands DCP (model and
    optimizer)."""
    strategy = parallel.build_fabric(cfg).strategy
    with fake_rank(rank):
        mesh = lightning_mesh(strategy)
        model = strategy._parallelize_fn(model, mesh)
        parallel.synchronize_replicas(model)
        params = dict(model.named_parameters())
        view = RankView(
            rank,
            (tuple(mesh.shape), mesh.mesh_dim_names),
            [describe(p.device_mesh) for p in params.values()],
            {tuple(p.placements) for p in params.values()},
            {name: tuple(p.to_local().shape) for name, p in params.items()},
            fsdp2_storage(model),
        )
        if save is not None:
            view.planner, view.save_plan = local_save_plan(
                strategy, rank, model, build_optimizer(model, cfg), save / f"rank{rank}"
            )
    return view


def local_save_plan(strategy, rank: int, model, optimizer, folder: Path):
    """The state dict Lightning's ModelParallelStrategy.save_checkpoint hands `dcp.save` (Trainer.save's objects,
    sharded), through DCP's DefaultSavePlanner (what dcp.save uses): (planner, local plan). Lightning's rank 0
    writes its `meta.pt` in `folder`."""
    from lightning.fabric.strategies import model_parallel
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    handed = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            model_parallel,
            "_distributed_checkpoint_save",
            lambda state, path: handed.update(state=state),
        )
        model_parallel._save_checkpoint(
            folder,
            {"model": model, "optimizer": optimizer},
            full_state_dict=not strategy._save_distributed_checkpoint,
            rank=rank,
        )
    planner = DefaultSavePlanner()
    planner.set_up_planner(handed["state"], storage_meta=None, is_coordinator=rank == 0)
    return planner, planner.create_local_plan()


@pytest.fixture(scope="module")
def small_world(tmp_path_factory, one_thread):
    """Every rank of the 16 with the small model on CPU: (config, views by rank)."""
    out = tmp_path_factory.mktemp("fake_world")
    cfg = paper_config(out, **SMALL)
    views = []
    for rank in range(WORLD):
        torch.manual_seed(cfg.seed)
        model = Transformer(resolve_model_config(cfg), attention_backend="sdpa")
        views.append(shard_rank(cfg, rank, model, save=out / "saves"))
    return cfg, views


@pytest.fixture(scope="module")
def paper_ranks(tmp_path_factory, one_thread):
    """RANKS with the paper's 1.3B model on the meta device: (config, views)."""
    cfg = paper_config(tmp_path_factory.mktemp("paper"))
    config = resolve_model_config(cfg)
    return cfg, [shard_rank(cfg, r, memory.meta_model(config), save=None) for r in RANKS]


@pytest.mark.slow
def test_the_paper_config_on_two_nodes_is_hybrid(paper_ranks):
    cfg, _ = paper_ranks
    assert cfg.fsdp == "auto" and cfg.fsdp_mesh_shape(DEVICES) == (NODES, DEVICES)
    assert memory.fsdp_shards(cfg, WORLD) == DEVICES


@pytest.mark.slow
@pytest.mark.parametrize("which", ["paper", "small"])
def test_each_rank_shards_within_its_node_and_replicates_across_nodes(
    which, paper_ranks, small_world
):
    from torch.distributed.tensor import Replicate, Shard

    _, views = paper_ranks if which == "paper" else small_world
    for view in views:
        assert view.lightning == ((WORLD, 1), ("data_parallel", "tensor_parallel"))
        assert all(m == expected_mesh(view.rank) for m in view.meshes), (
            view.rank,
            view.meshes[0],
        )
        assert view.placements == {(Replicate(), Shard(0))}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["paper", "small"])
def test_local_shards_are_torch_chunk_rows_and_the_plan_counts_fsdp2_storage(
    which, paper_ranks, small_world
):
    """Local shard: rows by hand (torch.chunk). FSDP2's storage: ceil(dim0 / 8) rows on every rank, padded (also
    where the shard is short or empty), which memory.shard_numel and memory.state_bytes count."""
    cfg, views = paper_ranks if which == "paper" else small_world
    whole = dict(memory.meta_model(resolve_model_config(cfg)).named_parameters())
    shards = memory.fsdp_shards(cfg, WORLD)
    for view in views:
        assert set(view.local) == set(view.storage) == set(whole), view.rank
        for name, p in whole.items():
            dim0, rest = p.shape[0], p.shape[1:]
            assert view.local[name] == (expected_rows(dim0, view.rank), *rest), (view.rank, name)
            padded = rows_per_shard(dim0) * rest.numel()
            assert memory.shard_numel(p, shards) == padded == view.storage[name], (view.rank, name)
        assert memory.state_bytes(memory.meta_model(resolve_model_config(cfg)), shards)[
            0
        ] == 4 * sum(view.storage.values())
    if which == "small":  # the small model has every case: full, short and empty shards
        rows = {
            (expected_rows(p.shape[0], v.rank), rows_per_shard(p.shape[0]))
            for v in views
            for p in whole.values()
        }
        assert any(r == per for r, per in rows) and any(0 < r < per for r, per in rows)
        assert any(r == 0 for r, _ in rows)
    else:  # every dimension of the 1.3B model divides by 8
        assert all(p.shape[0] % DEVICES == 0 for p in whole.values())


def item_key(item) -> tuple:
    offset = item.index.offset
    return item.index.fqn, None if offset is None else tuple(offset)


@pytest.mark.slow
def test_dcp_writes_each_shard_of_the_two_replicas_and_each_replicated_item_once(small_world):
    """DCP's local plans: each rank's chunk of every sharded tensor (parameters, AdamW's moments) is the rows by
    hand, so every chunk is planned twice, by rank s and s + 8; replicated items (AdamW's step counters, the
    param_groups' values) by all 16. After the global planning's dedup: each item by one rank, the chunks tiling
    every tensor exactly once (one copy written, not two)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    cfg, views = small_world
    whole = dict(memory.meta_model(resolve_model_config(cfg)).named_parameters())
    local = [view.save_plan for view in views]
    shapes = {}  # fqn of a sharded tensor -> its global shape
    for name, p in whole.items():
        shapes[f"model.{name}"] = p.shape
        for moment in ("exp_avg", "exp_avg_sq"):
            shapes[f"optimizer.state.{name}.{moment}"] = p.shape
    steps = {f"optimizer.state.{name}.step" for name in whole}

    holders: dict[tuple, set[int]] = {}
    for rank, p in enumerate(local):
        sharded = {i.index.fqn: i for i in p.items if i.type == WriteItemType.SHARD}
        assert set(sharded) == set(shapes), rank
        for fqn, item in sharded.items():
            dim0, rest = shapes[fqn][0], tuple(shapes[fqn][1:])
            start = min((rank % DEVICES) * rows_per_shard(dim0), dim0)
            chunk = item.tensor_data.chunk
            assert tuple(chunk.offsets) == (start,) + (0,) * len(rest), (rank, fqn)
            assert tuple(chunk.sizes) == (expected_rows(dim0, rank), *rest), (rank, fqn)
        replicated = {i.index.fqn for i in p.items if i.type != WriteItemType.SHARD}
        assert steps <= replicated and any(
            f.startswith("optimizer.param_groups.") for f in replicated
        )
        for item in p.items:
            holders.setdefault(item_key(item), set()).add(rank)

    def is_empty_chunk(key):
        return key[0] in shapes and key[1][0] == shapes[key[0]][0]

    for key, ranks in holders.items():
        if key[0] not in shapes:
            assert ranks == set(range(WORLD)), key
        elif not is_empty_chunk(key):
            index = key[1][0] // rows_per_shard(shapes[key[0]][0])
            assert ranks == {index, index + DEVICES}, key

    final, metadata = views[0].planner.create_global_plan(local)  # raises if chunks overlap
    writers: dict[tuple, list[int]] = {}
    for rank, p in enumerate(final):
        for item in p.items:
            writers.setdefault(item_key(item), []).append(rank)
    assert set(writers) == set(holders)
    assert all(len(ranks) == 1 for ranks in writers.values()), {
        k: r for k, r in writers.items() if len(r) != 1
    }
    assert all(writers[key][0] in holders[key] for key in writers)

    planned = {fqn: 0 for fqn in shapes}
    written = {fqn: 0 for fqn in shapes}
    for plans, count in ((local, planned), (final, written)):
        for p in plans:
            for item in p.items:
                if item.type == WriteItemType.SHARD:
                    count[item.index.fqn] += item.tensor_data.chunk.sizes.numel()
    assert planned == {fqn: NODES * shape.numel() for fqn, shape in shapes.items()}
    assert written == {fqn: shape.numel() for fqn, shape in shapes.items()}
    for fqn, shape in shapes.items():
        rows = sorted(
            (c.offsets[0], c.offsets[0] + c.sizes[0])
            for c in metadata.state_dict_metadata[fqn].chunks
            if c.sizes[0]
        )
        assert metadata.state_dict_metadata[fqn].size == shape
        assert [a for a, _ in rows] == [0] + [b for _, b in rows[:-1]] and rows[-1][1] == shape[0]
    # DCP spreads the writes over both replicas, so a checkpoint holds some shards of node 1's replica: why
    # parallel.synchronize_replicas makes the replicas identical before training
    assert {rank // DEVICES for ranks in writers.values() for rank in ranks} == {0, 1}
