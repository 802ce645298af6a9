"""The job plan (train.preflight.plan): its memory figures against a real model on CPU, and the paper's 2K run."""

from __future__ import annotations

from pathlib import Path

import pytest

from posfreq.scripts.commands import plan as plan_command
from posfreq.train.preflight import plan
from posfreq.train.run import memory
from posfreq.train.run.config import config_from_dict, parse_args
from posfreq.train.run.geometry import batch_geometry, resolve_model_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_paper_2k_run_fits_on_16_a100_80gb_with_sane_days(capsys):
    cfg = parse_args(["--config", str(CONFIGS / "pretrain_2k.yaml")])
    gpu = plan.GPUS["a100-80gb"]
    model = memory.meta_model(resolve_model_config(cfg))
    assert sum(p.numel() for p in model.parameters()) == 1_494_312_960
    assert batch_geometry(cfg, 16).accumulation == 16  # as the config's comment says
    mem = memory.memory(model, cfg, 16, cfg.micro_batch_rows, checkpointing=False)
    assert mem.total <= plan.usable_bytes(gpu)
    assert (
        memory.largest_rows(model, cfg, 16, plan.usable_bytes(gpu), checkpointing=False)
        >= cfg.micro_batch_rows
    )
    steps = -(-cfg.total_tokens // cfg.global_batch_tokens)
    days = steps * plan.step_seconds(cfg, resolve_model_config(cfg), 16, gpu, 0.4) / 86400
    assert 20 < days < 80  # the paper reports about 28 days
    assert 0.3 < plan.tinyllama_mfu(gpu) < 0.7

    assert (
        plan_command.main(
            [
                "--config",
                str(CONFIGS / "pretrain_2k.yaml"),
                "--num-nodes",
                "2",
                "--devices",
                "8",
                "--gpu",
                "a100-80gb",
                "--micro-batch-rows",
                "4",
                "--mfu",
                "0.4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "fit, model.compile (on GPUs by default): fits" in out
        and "fit, eager: fits" in out
        and "16 GPUs x 32 micro-batches x 4 rows" in out
    )
    assert f"{days:.1f} days for 1,000,000,000,000 tokens" in out
    # besides --mfu, the GPU's own figure, and whether posfreq measured it there
    table = plan.tinyllama_mfu(gpu)
    assert "a100-80gb (assumed: TinyLlama-1.1B's published" in out and f"MFU {table:.3f}" in out


def test_the_40gb_config_is_the_2k_run_at_the_rows_that_fit_an_a100_40gb():
    """On A100-40GB the paper's config (8 rows per micro-batch) does not fit by the eager upper bound (compile has
    not run on an A100, so its calibration is not relied on there); the 40GB config is the same training
    (every setting but the micro-batch equal, so the same global batch and optimisation) at the largest row count
    that fits and divides a step's rows per GPU."""
    import yaml

    paper = yaml.safe_load((CONFIGS / "pretrain_2k.yaml").read_text())
    small = yaml.safe_load((CONFIGS / "pretrain_2k_a100_40gb.yaml").read_text())
    assert {k: v for k, v in small.items() if k != "micro_batch_rows"} == {
        k: v for k, v in paper.items() if k != "micro_batch_rows"
    }
    gpu = plan.GPUS["a100-40gb"]
    cfgs = [
        parse_args(["--config", str(CONFIGS / name)])
        for name in ("pretrain_2k.yaml", "pretrain_2k_a100_40gb.yaml")
    ]
    model = memory.meta_model(resolve_model_config(cfgs[0]))
    fits = [
        memory.memory(model, cfg, 16, cfg.micro_batch_rows, checkpointing=False).total
        <= plan.usable_bytes(gpu)
        for cfg in cfgs
    ]
    assert fits == [False, True]
    geometry = batch_geometry(cfgs[1], 16)
    assert geometry.accumulation == 2 * batch_geometry(cfgs[0], 16).accumulation
    rows_per_gpu = cfgs[1].global_batch_tokens // cfgs[1].data.train_len // 16
    larger = [
        r for r in range(cfgs[1].micro_batch_rows + 1, rows_per_gpu + 1) if rows_per_gpu % r == 0
    ]
    assert all(
        memory.memory(model, cfgs[1], 16, r, checkpointing=False).total > plan.usable_bytes(gpu)
        for r in larger
    )


def test_each_gpu_says_whether_its_mfu_was_measured_or_assumed():
    for name in plan.GPUS:
        mfu, source = plan.expected_mfu(name)
        assert 0.2 < mfu < 0.8 and source.split(":")[0] in ("measured", "assumed"), (name, source)
    # the figures docs/cluster.md records from make gpu-check (42.1% and 44.6% of the datasheet peak)
    assert plan.expected_mfu("h200")[0] == 0.446 and plan.expected_mfu("h100-sxm")[0] == 0.421
    assert plan.expected_mfu("h200")[1].startswith("measured")
    assert plan.expected_mfu("h100-sxm")[1].startswith("measured")
    assert plan.expected_mfu("h100-pcie")[1].startswith("assumed")


def test_the_plan_needs_a_gpu_count():
    """`devices: auto` (the paper configs') names no GPU count: the plan asks for --devices instead of guessing."""
    with pytest.raises(SystemExit, match="give --devices"):
        plan_command.main(["--config", str(CONFIGS / "pretrain_2k.yaml"), "--num-nodes", "2"])


def test_4k_run_accumulates_twice_as_much():
    cfg = parse_args(["--config", str(CONFIGS / "pretrain_4k.yaml")])
    assert batch_geometry(cfg, 16).accumulation == 32


def test_the_plan_takes_the_datas_vocabulary_as_the_trainer_does(tmp_path):
    """The trainer sizes the embedding and head by the token shards' vocabulary: so does the plan, where the data
    is, and it says whose vocabulary it planned with where the data is not."""
    from posfreq.train.preflight.pretrain_check import write_tiny_corpus

    data = write_tiny_corpus(tmp_path / "bytes")  # 258 byte tokens
    preset = {"data": {"train_len": 64}, "model": {"preset": "tiny-2l-128"}}
    here = plan.report(
        config_from_dict({**preset, "data": {"train_len": 64, "dir": str(data)}}), 1, 1, "h200"
    )
    assert f"vocab 258 (the data's, {data})" in here
    away = plan.report(
        config_from_dict({**preset, "data": {"train_len": 64, "dir": str(tmp_path / "elsewhere")}}),
        1,
        1,
        "h200",
    )
    assert "vocab 128,256 (the preset's: data.dir" in away and "is not here" in away
    params = [
        line
        for line in (here, away)
        for line in line.splitlines()
        if line.startswith("parameters:")
    ]
    assert params[0] != params[1]  # the embedding and head follow the vocabulary
