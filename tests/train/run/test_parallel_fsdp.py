"""FSDP2 across a step's micro-batches and nodes (train/run/parallel.py): each module is all-gathered once per optimizer
step however many micro-batches it accumulates, with the losses of resharding after every micro-batch, and hybrid
sharding (HSDP: sharded within a node, replicated across nodes) trains as one process does."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.trainer import ROOT, run, subprocess_env, tiny, weights

from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.run import memory
from posfreq.train.run.config import ConfigError, config_from_dict
from posfreq.train.run.geometry import resolve_model_config
from posfreq.train.run.resume_changes import config_differences

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# A trainer process that records, for every optimizer step on every rank, FSDP2's all-gathers (the one call every
# unshard makes, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: FSDPParamGroup.unshard), whether every
# parameter is sharded again afterwards (a gathered one is a plain tensor, a sharded one a DTensor), and the mesh.
# RESHARD_EVERY_MICRO_BATCH=1 restores the former schedule: FSDP2's defaults on every micro-batch.
COUNTING = """
import json, os, sys
from pathlib import Path
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from posfreq.train.run import parallel
from posfreq.scripts.commands import pretrain
from posfreq.train.run import trainer

calls = []
real_gather = param_group.foreach_all_gather
def counted(*args, **kwargs):
    calls.append(1)
    return real_gather(*args, **kwargs)
param_group.foreach_all_gather = counted

if os.environ.get("NODE_RANK", "0") in os.environ.get("OTHER_INIT_ON_NODES", "").split(","):
    import torch  # this node draws other initial weights, as a node with another CPU might
    real_seed = torch.manual_seed
    torch.manual_seed = lambda seed: real_seed(seed + 1)

if os.environ.get("RESHARD_EVERY_MICRO_BATCH") == "1":
    trainer.reshard_for_micro_batch = lambda model, index, count: parallel.default_resharding(model)

real_step = trainer.Trainer._train_step
def step(self, batches, n_targets):
    before = len(calls)
    out = real_step(self, batches, n_targets)
    mesh = self.params[0].device_mesh
    row = {
        "micro_batches": len(batches),
        "gathers": len(calls) - before,
        "sharded_after": all(isinstance(p, DTensor) for p in self.model.module.parameters()),
        "sync_after": all(
            group.reduce_grads
            for module in self.model.module.modules()
            if isinstance(module, FSDPModule)
            for group in [module._get_fsdp_state()._fsdp_param_group]
            if group is not None
        ),
        "mesh": [list(mesh.shape), list(mesh.mesh_dim_names or ())],
    }
    with open(Path(os.environ["GATHERS_DIR"]) / f"rank{self.fabric.global_rank}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\\n")
    return out
trainer.Trainer._train_step = step
sys.exit(pretrain.main())
"""


def counted_run(tmp_path: Path, name: str, cfg: dict, nodes: int = 1, **env: str) -> Path:
    """Train `cfg` in a child process per node (Fabric starts the node's other ranks) with COUNTING; returns the
    folder of its per-rank records."""
    script, config, gathers = (
        tmp_path / "count_gathers.py",
        tmp_path / f"{name}.json",
        tmp_path / f"gathers_{name}",
    )
    script.write_text(COUNTING)
    config.write_text(json.dumps(cfg))
    gathers.mkdir()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} if nodes > 1 else {}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "--config", str(config)],
            env=subprocess_env(
                GATHERS_DIR=str(gathers),
                **rendezvous,
                **env,
                **({"NODE_RANK": str(node)} if nodes > 1 else {}),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for node in range(nodes)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    return gathers


def free_port() -> int:
    """A TCP port nothing listens on now, for the nodes' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(gathers: Path) -> list[list[dict]]:
    """Each rank's per-step records, by rank."""
    return [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(gathers.glob("rank*.jsonl"))
    ]


def losses(out: Path) -> list[float]:
    """The logged loss of every step (metrics.jsonl keeps every float's exact repr)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def gathers_per_step(gathers: Path) -> set[int]:
    """The all-gathers of a step, as every rank and step counted them (one value when all agree)."""
    return {row["gathers"] for rank in records(gathers) for row in rank}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fsdp, nodes, devices, shape",
    [
        ("full", 1, 8, (1, 8)),
        ("hybrid", 1, 8, (1, 8)),  # one node: hybrid is full sharding
        ("auto", 1, 8, (1, 8)),
        ("full", 2, 8, (1, 16)),
        ("hybrid", 2, 8, (2, 8)),
        ("auto", 2, 8, (2, 8)),
        ("auto", 4, 1, (4, 1)),
    ],
)
def test_fsdp_mesh_shape_shards_within_a_node_under_hybrid(
    data_dir, tmp_path, fsdp, nodes, devices, shape
):
    cfg = config_from_dict(tiny(data_dir, tmp_path, fsdp=fsdp, num_nodes=nodes))
    assert cfg.fsdp_mesh_shape(devices) == shape


def test_fsdp_is_checked_and_may_change_on_resume(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="fsdp"):
        config_from_dict(tiny(data_dir, tmp_path, fsdp="zero3"))
    full = config_from_dict(tiny(data_dir, tmp_path, fsdp="full")).to_dict()
    hybrid = config_from_dict(tiny(data_dir, tmp_path, fsdp="hybrid")).to_dict()
    assert (
        config_differences(full, hybrid) == []
    )  # the same gradients: a checkpoint resumes under either


@pytest.mark.slow
def test_plan_counts_the_whole_compute_copy_when_accumulating_and_node_shards_under_hybrid(
    data_dir, tmp_path
):
    """Accumulating steps keep every block gathered (train/parallel.reshard_for_micro_batch); hybrid sharding keeps
    one copy of the fp32 state per node."""
    four_blocks = {"model.overrides.n_layers": 4}
    cfg = config_from_dict(tiny(data_dir, tmp_path, **four_blocks))
    model = memory.meta_model(resolve_model_config(cfg))
    total = sum(p.numel() for p in model.parameters())
    rows = cfg.global_batch_tokens // cfg.data.train_len  # one micro-batch on one rank
    one_step = memory.memory(model, cfg, 1, rows, checkpointing=False)
    accumulating = memory.memory(model, cfg, 1, rows // 2, checkpointing=False)
    assert one_step.gathered < 4 * total == accumulating.gathered  # 32-true: a 4-byte compute copy
    for fsdp, shards in (("auto", 8), ("full", 16)):
        two_nodes = config_from_dict(
            tiny(data_dir, tmp_path, num_nodes=2, fsdp=fsdp, **four_blocks)
        )
        assert (
            memory.memory(model, two_nodes, 16, 1, False).parameters
            == memory.state_bytes(model, shards)[0]
        )


@pytest.mark.slow  # four runs of two gloo processes
@pytest.mark.e2e  # four runs of two processes
def test_one_all_gather_per_module_and_step_however_many_micro_batches(data_dir, tmp_path):
    """2 ranks of a 2-block model (3 FSDP2 modules: 2 blocks and the root) train 3 steps of 8 rows, as 1, 2 or 4
    micro-batches of 4, 2 or 1 rows per rank. One micro-batch: the first block is gathered in forward and again in
    backward, the last block and the root once (4). Several: each module once per step (3), where resharding after
    every micro-batch gathered 4 per micro-batch; the losses are bitwise those of resharding, and every parameter
    is sharded again after each step. The 4-micro-batch pair runs in bf16 with activation checkpointing."""
    common = {"devices": 2, "total_tokens": 3 * 1024, "checkpoint.latest_every_steps": 0}
    bf16_ac = {"precision": "bf16-mixed", "model.activation_checkpointing": True}
    gathered = {}
    for rows in (4, 2):
        cfg = tiny(data_dir, tmp_path / f"rows{rows}", micro_batch_rows=rows, **common)
        gathered[rows] = counted_run(tmp_path, f"rows{rows}", cfg)
    for name, reshard in (("kept", "0"), ("resharded", "1")):
        cfg = tiny(data_dir, tmp_path / name, micro_batch_rows=1, **common, **bf16_ac)
        gathered[name] = counted_run(tmp_path, name, cfg, RESHARD_EVERY_MICRO_BATCH=reshard)

    for name, micro_batches, gathers in (
        (4, 1, 4),
        (2, 2, 3),
        ("kept", 4, 3),
        ("resharded", 4, 16),
    ):
        steps = records(gathered[name])
        assert len(steps) == 2 and all(len(rank) == 3 for rank in steps), steps
        assert {row["micro_batches"] for rank in steps for row in rank} == {micro_batches}
        assert gathers_per_step(gathered[name]) == {gathers}, (name, steps)
        assert all(row["sharded_after"] for rank in steps for row in rank), (name, steps)
        assert all(row["sync_after"] for rank in steps for row in rank), (name, steps)
    assert losses(tmp_path / "kept") == losses(tmp_path / "resharded")
    np.testing.assert_allclose(losses(tmp_path / "rows2"), losses(tmp_path / "rows4"), rtol=1e-5)


@pytest.mark.slow  # two child processes per node, and a one-process run
@pytest.mark.e2e  # runs of four processes
def test_hybrid_sharding_over_two_nodes_trains_as_one_process_and_resumes_there(data_dir, tmp_path):
    """2 nodes x 2 ranks on one machine (NODE_RANK and a shared rendezvous): `fsdp: auto` shards within each node
    and replicates across the two, accumulating 2 micro-batches per step with one all-gather per module; the
    losses and the final weights are one process's, and one process resumes its sharded checkpoint exactly.
    Node 1 draws other initial weights: the first replica's are copied to it before training."""
    geometry = {"micro_batch_rows": 1, "total_tokens": 6 * 1024}
    single = run(tiny(data_dir, tmp_path / "one", micro_batch_rows=2, total_tokens=6 * 1024))
    cfg = tiny(data_dir, tmp_path / "hsdp", devices=2, num_nodes=2, stop_at_step=4, **geometry)
    gathers = counted_run(tmp_path, "hsdp", cfg, nodes=2, OTHER_INIT_ON_NODES="1")
    steps = records(gathers)
    assert len(steps) == 4 and all(len(rank) == 4 for rank in steps), steps
    assert {json.dumps(row["mesh"]) for rank in steps for row in rank} == {
        json.dumps([[2, 2], ["replicate", "shard"]])
    }
    assert gathers_per_step(gathers) == {3} and all(
        row["sharded_after"] for rank in steps for row in rank
    )
    hsdp = losses(tmp_path / "hsdp")
    np.testing.assert_allclose(hsdp, [r["loss"] for r in single[:4]], rtol=1e-5)
    resumed = run(tiny(data_dir, tmp_path / "hsdp", micro_batch_rows=2, total_tokens=6 * 1024))
    assert [r["step"] for r in resumed] == [5, 6]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in single[4:]], rtol=1e-5
    )
    end = ckpt.milestone_name(6 * 1024)
    a, b = weights(tmp_path / "one/checkpoints" / end), weights(tmp_path / "hsdp/checkpoints" / end)
    for key in a:
        np.testing.assert_allclose(a[key].numpy(), b[key].numpy(), rtol=1e-4, atol=1e-5)
