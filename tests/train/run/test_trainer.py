"""Trainer tests on CPU: loss falls, exact resume, length histogram, accumulation, non-finite losses, validation,
logs, several processes and precisions, as the user sees them."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.trainer import (
    ROOT,
    run,
    sigusr1_in_a_slurm_job,
    subprocess_env,
    tiny,
    weights,
)

from posfreq.scripts.commands import pretrain
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.data.packing import PackedSampler
from posfreq.train.data.packing_schedule import RowPacking
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.model.transformer import Transformer
from posfreq.train.run.config import ConfigError
from posfreq.train.run.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_loss_falls(data_dir, tmp_path):
    history = run(
        tiny(
            data_dir,
            tmp_path,
            total_tokens=20 * 1024,
            **{"checkpoint.latest_every_steps": 0, "checkpoint.every_tokens": 10**9},
        )
    )
    losses = [row["loss"] for row in history]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 21))
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"} <= set(lines[0])


@pytest.mark.slow
def test_resume_is_bitwise_identical_and_histogram_matches(data_dir, tmp_path):
    full = run(tiny(data_dir, tmp_path / "full"))
    first = run(tiny(data_dir, tmp_path / "split", stop_at_step=3))
    assert (tmp_path / "split/checkpoints/latest").is_dir()
    second = run(tiny(data_dir, tmp_path / "split"))
    assert [r["step"] for r in first + second] == list(range(1, 9))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in full]
    assert [r["grad_norm"] for r in first + second] == [r["grad_norm"] for r in full]
    end = ckpt.milestone_name(8 * 1024)
    a, b = (
        weights(tmp_path / "full/checkpoints" / end),
        weights(tmp_path / "split/checkpoints" / end),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logged = [
        json.loads(x)["loss"] for x in (tmp_path / "split/metrics.jsonl").read_text().splitlines()
    ]
    assert logged == [r["loss"] for r in full]

    # Independent count: a fresh sampler, one global batch of 8 rows per step, lengths from cu_seqlens.
    sampler = PackedSampler(TokenDataset(data_dir), 128, 8, seed=1)
    expected = np.zeros(129, dtype=np.int64)
    for step in range(8):
        expected += np.bincount(np.diff(next(sampler).cu_seqlens.numpy()), minlength=129)
        if step == 3:  # the milestone at 4096 tokens holds the first 4 steps
            got = ckpt.load_trained_lengths(
                tmp_path / "split/checkpoints" / ckpt.milestone_name(4096)
            )
            assert np.array_equal(got, expected)
    for run_dir in ("full", "split"):
        assert np.array_equal(
            ckpt.load_trained_lengths(tmp_path / run_dir / "checkpoints" / end), expected
        )
    assert expected.sum() > 8 * 8 and expected[128] > 0  # many segments, some full rows


@pytest.mark.slow
def test_init_from_carries_weights_and_trained_lengths(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path / "warm", total_tokens=4096))
    warm = tmp_path / "warm/checkpoints" / ckpt.milestone_name(4096)
    # Continued at a longer training length, with lr 0: the single step changes nothing, so the
    # weights must be the warm-up's, and the histogram the warm-up's plus this step's segments.
    run(
        tiny(
            data_dir,
            tmp_path / "next",
            total_tokens=1024,
            **{
                "model.init_from": str(warm),
                "optim.lr": 0.0,
                "optim.min_lr": 0.0,
                "data.train_len": 256,
            },
        )
    )
    final = tmp_path / "next/checkpoints" / ckpt.milestone_name(1024)
    a, b = weights(warm), weights(final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    own = np.bincount(
        np.diff(next(PackedSampler(TokenDataset(data_dir), 256, 4, seed=1)).cu_seqlens.numpy()),
        minlength=257,
    )
    carried = np.zeros(257, dtype=np.int64)
    carried[:129] = ckpt.load_trained_lengths(warm)
    assert np.array_equal(ckpt.load_trained_lengths(final), carried + own)
    # Each checkpoint records the length it was trained at (STRING's defaults derive from it).
    assert [
        json.loads((d / "model_config.json").read_text())["train_len"] for d in (warm, final)
    ] == [128, 256]
    other = tiny(
        data_dir, tmp_path / "bad", **{"model.init_from": str(warm), "model.overrides.d_model": 128}
    )
    with pytest.raises(ConfigError, match="init_from"):
        run(other)
    shorter = tiny(
        data_dir, tmp_path / "short", **{"model.init_from": str(final), "data.train_len": 128}
    )
    with pytest.raises(ConfigError, match="longer than data.train_len"):
        run(shorter)
    damaged = tmp_path / "damaged"  # a copy of the warm-up with one byte of its state flipped
    shutil.copytree(warm, damaged)
    shard = max((damaged / ckpt.STATE_DIR).glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    from_damaged = tiny(data_dir, tmp_path / "d", **{"model.init_from": str(damaged)})
    with pytest.raises(CheckpointError, match=f"model.init_from: {shard}: its sha256 differs"):
        run(from_damaged)


def test_gradient_accumulation_matches_one_big_batch(data_dir, tmp_path):
    cfg = dict(total_tokens=2 * 1024, **{"checkpoint.latest_every_steps": 0})
    micro = run(tiny(data_dir, tmp_path / "micro", micro_batch_rows=2, **cfg))  # 4 micro-batches
    big = run(tiny(data_dir, tmp_path / "big", micro_batch_rows=8, **cfg))  # one batch of 8 rows
    for m, b in zip(micro, big):
        assert m["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    end = ckpt.milestone_name(2048)
    a, b = (
        weights(tmp_path / "micro/checkpoints" / end),
        weights(tmp_path / "big/checkpoints" / end),
    )
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_nonfinite_loss_stops_with_resume_hint_or_skips(data_dir, tmp_path):
    cfg = tiny(
        data_dir,
        tmp_path / "stop",
        total_tokens=6 * 1024,
        **{
            "optim.lr": 1e30,
            "optim.warmup_steps": 1,
            "optim.grad_clip": 0.0,
            "checkpoint.latest_every_steps": 1,
        },
    )
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite loss or gradient norm .* at step \d+ .*resume from .*latest",
    ):
        run(cfg)
    cfg = tiny(
        data_dir,
        tmp_path / "skip",
        total_tokens=6 * 1024,
        on_nonfinite="skip",
        **{"optim.lr": 1e30, "optim.warmup_steps": 1, "optim.grad_clip": 0.0},
    )
    history = run(cfg)
    assert len(history) == 6 and history[-1]["skipped"]


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_nonfinite_loss_error_names_a_command_that_continues(data_dir, tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            tiny(
                data_dir,
                tmp_path / "run",
                total_tokens=4 * 1024,
                **{"checkpoint.latest_every_steps": 1},
            )
        )
    )
    real_step = Trainer._train_step

    def nan_at_step_3(self, batches, n):
        loss, grad_norm = real_step(self, batches, n)
        return (loss * float("nan"), grad_norm) if self.step == 2 else (loss, grad_norm)

    monkeypatch.setattr(Trainer, "_train_step", nan_at_step_3)
    with pytest.raises(SystemExit) as stopped:
        pretrain.main(["--config", str(config)])
    message = str(stopped.value.code)
    latest = tmp_path / "run/checkpoints" / ckpt.LATEST
    assert (
        message.startswith("error: non-finite loss or gradient norm (loss nan")
        and "\n" not in message
    ), message
    assert (
        f"at step 3 (tokens 2,048-3,072); the weights were not updated. To continue: resume from {latest}"
        in message
    )
    command = shlex.split(message.split(" Command: ")[1])
    assert command == [
        "posfreq",
        "pretrain",
        "--config",
        str(config),
        "--resume",
        "auto",
        "--resume-override",
        "{optim.lr: 0.0003}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "posfreq.scripts.cli", *command[1:]],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {latest} at step 2" in proc.stdout
    # one process: no Lightning distributed banner
    assert "distributed_backend" not in proc.stdout + proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert (
        "resume_override: optim.lr: 0.003 -> 0.0003; schedule from step 2: next LR 0.003 -> 0.0003"
        in proc.stdout
    )
    assert ckpt.read_trainer_state(latest)["config"]["optim"]["lr"] == 0.0003


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
@pytest.mark.e2e  # a run of two processes and one of one
def test_two_gloo_processes_match_one_process(data_dir, tmp_path):
    val = {
        "data.val_dir": str(data_dir),
        "data.val_rows": 5,
    }  # rank 1 runs out of rows in the second round
    single = run(tiny(data_dir, tmp_path / "one", micro_batch_rows=2, **val))
    base = [sys.executable, str(ROOT / "train/pretrain.py")]
    cfg_path = tmp_path / "two.json"
    cfg_path.write_text(
        json.dumps(tiny(data_dir, tmp_path / "two", devices=2, micro_batch_rows=2, **val))
    )
    env = subprocess_env()
    latest = tmp_path / "two/checkpoints" / ckpt.LATEST
    for extra in (["--stop_at_step", "5"], []):  # interrupted after step 5, then resumed
        if not extra:  # rank 1's shard of the newest checkpoint damaged in its bytes, not its size
            shard = latest / "state/__1_0.distcp"
            shard.write_bytes(shard.read_bytes()[::-1])
        proc = subprocess.run(
            base + ["--config", str(cfg_path)] + extra,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    # Only rank 0 read the checksums; both ranks resumed the milestone it chose (else the losses would differ).
    resumed = proc.stdout + proc.stderr
    assert f"skipped checkpoint {latest}: " in resumed and "sha256 differs" in resumed
    assert (
        f"resumed from {tmp_path / 'two/checkpoints' / ckpt.milestone_name(4096)} at step 4"
        in resumed
    )
    logged = [json.loads(x) for x in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged if "loss" in x] == list(range(1, 9))
    np.testing.assert_allclose(
        [x["loss"] for x in logged if "loss" in x], [r["loss"] for r in single], rtol=1e-5
    )
    one_val = [
        json.loads(x)
        for x in (tmp_path / "one/metrics.jsonl").read_text().splitlines()
        if "val_loss" in x
    ]
    two_val = [x for x in logged if "val_loss" in x]
    assert [x["step"] for x in two_val] == [x["step"] for x in one_val] == [4, 8]  # each milestone
    for one, two in zip(one_val, two_val):
        assert two["val_targets"] == one["val_targets"]
        assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    end = ckpt.milestone_name(8 * 1024)
    by_distance = [  # summed over ranks: the same table as one process's
        json.loads((tmp_path / r / "checkpoints" / end / ckpt.LOSS_BY_DISTANCE_FILE).read_text())
        for r in ("one", "two")
    ]
    assert by_distance[0]["tokens"] == by_distance[1]["tokens"]
    np.testing.assert_allclose(by_distance[0]["loss_sum"], by_distance[1]["loss_sum"], rtol=1e-5)
    assert (
        tmp_path / "two/checkpoints" / end / "state/__1_0.distcp"
    ).is_file()  # really sharded over 2 ranks
    a, b = weights(tmp_path / "one/checkpoints" / end), weights(tmp_path / "two/checkpoints" / end)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(
        ckpt.load_trained_lengths(tmp_path / "one/checkpoints" / end),
        ckpt.load_trained_lengths(tmp_path / "two/checkpoints" / end),
    )


@pytest.mark.slow
def test_torn_metrics_line_is_set_aside_on_resume(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path, total_tokens=3 * 1024, **{"checkpoint.latest_every_steps": 1})
    run({**cfg, "stop_at_step": 2})
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "tokens": 3072, "lo')  # killed mid-write
    history = run(cfg)
    assert [r["step"] for r in history] == [3]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert (
        tmp_path / "metrics.jsonl.unreadable"
    ).read_text() == '{"step": 3, "tokens": 3072, "lo\n'
    assert not list(tmp_path.glob(".metrics.jsonl.*.tmp"))  # the atomic rewrite left no temporary


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_cluster_log_is_plain_timestamped_lines_with_a_summary(data_dir, tmp_path):
    """stdout to a file (a SLURM .out): no progress bar, one parseable line per logged step, then a summary."""
    from posfreq.train.run.log import parse_line

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, tmp_path / "run", **{"logging.every_steps": 2})))
    log = tmp_path / "job.out"
    with log.open("w") as sink:
        proc = subprocess.run(
            [sys.executable, "-m", "posfreq.scripts.cli", "pretrain", "--config", str(config)],
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
            timeout=300,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = log.read_text()
    assert "\r" not in text and "pretrain:" not in text  # no tqdm
    lines = [parse_line(line) for line in text.splitlines()]
    stamp = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}$")
    assert all(stamp.match(line["time"]) for line in lines), text
    steps = [line for line in lines if "step" in line]
    assert [line["step"] for line in steps] == ["2/8", "4/8", "6/8", "8/8"]
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [float(line["loss"]) for line in steps] == pytest.approx(
        [m["loss"] for m in metrics], abs=5e-5
    )
    assert all(m["time"].endswith("+00:00") for m in metrics)
    summary = lines[-1]
    assert (summary["summary"], summary["steps"], summary["tokens"]) == (
        "finished",
        "1-8/8",
        "8.2k",
    ), summary
    assert float(summary["loss"]) == pytest.approx(metrics[-1]["loss"], abs=5e-5)
    assert summary["checkpoints"].split(",") == [
        "latest",
        "tokens-000000000004096",
        "tokens-000000000008192",
    ]


@pytest.mark.slow
def test_validation_loss_equals_a_full_logits_cross_entropy_of_the_final_weights(
    data_dir, tmp_path
):
    """data.val_dir: the logged val_loss is the mean token cross-entropy of the held-out rows under the weights of
    that step, computed here independently from full logits; training is unchanged by validating."""
    val = {"data.val_dir": str(data_dir), "data.val_every_tokens": 4096, "data.val_rows": 6}
    history = run(tiny(data_dir, tmp_path / "val", **val))
    rows = [json.loads(x) for x in (tmp_path / "val/metrics.jsonl").read_text().splitlines()]
    checks = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in checks] == [4, 8] and all(r["val_targets"] > 0 for r in checks)
    plain = run(tiny(data_dir, tmp_path / "plain"))
    assert [r["loss"] for r in history] == [
        r["loss"] for r in plain
    ]  # validating does not disturb training

    config = ckpt.load_model_config(tmp_path / "val/checkpoints" / ckpt.milestone_name(8192))
    model = Transformer(config).eval()
    model.load_state_dict(weights(tmp_path / "val/checkpoints" / ckpt.milestone_name(8192)))
    batch = next(
        PackedSampler(TokenDataset(data_dir), 128, 6, seed=0, packing=RowPacking(shuffle=False))
    )
    with torch.no_grad():
        logits = model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen)
    expected = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).double(), batch.targets.reshape(-1), ignore_index=-100
    )
    assert checks[-1]["val_targets"] == int((batch.targets != -100).sum())
    assert checks[-1]["val_loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
def test_the_last_step_of_an_invocation_is_logged_whatever_every_steps_says(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, stop_at_step=5, **{"logging.every_steps": 3}))
    logged = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3, 5]  # step 5 ends this job (stop_at_step): a requeue must not leave it out


@pytest.mark.slow
def test_saves_validation_requeue_and_resume_with_collectives_that_return_device_tensors(
    data_dir, tmp_path, monkeypatch, device_collectives
):
    """NCCL hands Fabric's collectives back on the GPU: every save, validation and requeue path must copy to host."""
    probe = device_collectives(torch.ones(2))
    with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
        probe.numpy()
    assert probe.tolist() == [1.0, 1.0] and probe.cpu().numpy().tolist() == [
        1.0,
        1.0,
    ]  # the double is strict, not broken
    with pytest.raises(TypeError, match="to numpy"):
        probe.unbind()[0].numpy()  # tuples of results stay on the device
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2) + probe  # CUDA refuses host and device operands together
    host = torch.zeros(2)
    host.copy_(probe)  # a copy into host memory is legal
    assert host.numpy().tolist() == [1.0, 1.0]
    val = {"data.val_dir": str(data_dir), "data.val_every_tokens": 2048, "data.val_rows": 4}
    real_step = Trainer._train_step
    calls = sigusr1_in_a_slurm_job(monkeypatch, "77", at_step=4)
    cfg = tiny(data_dir, tmp_path / "run", **val)
    first = run(
        cfg
    )  # milestone at step 4, latest every 2 steps, validation every 2 steps, SIGUSR1 -> requeue save
    assert calls == [["scontrol", "requeue", "77"]] and first[-1]["step"] == 6
    assert ckpt.read_trainer_state(tmp_path / "run/checkpoints/latest")["step"] == 6
    monkeypatch.setattr(Trainer, "_train_step", real_step)
    second = run(cfg)  # --resume auto from the requeue's save
    assert [r["step"] for r in first + second] == list(range(1, 9))
    full = run(tiny(data_dir, tmp_path / "full", **val))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in full]
    end = ckpt.milestone_name(8 * 1024)
    assert np.array_equal(
        ckpt.load_trained_lengths(tmp_path / "run/checkpoints" / end),
        ckpt.load_trained_lengths(tmp_path / "full/checkpoints" / end),
    )
    validated = [
        json.loads(x)
        for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
        if "val_loss" in x
    ]
    assert validated, "validation ran"


@pytest.mark.slow
def test_bf16_mixed_with_activation_checkpointing_trains_and_resumes_exactly(data_dir, tmp_path):
    """The production precision (configs/pretrain_2k.yaml): FSDP2's bf16 policy must leave the blocks' non-tensor
    inputs (the forward context, its position scheme) alone, and a resumed run equals an uninterrupted one."""
    bf16 = {
        "precision": "bf16-mixed",
        "model.activation_checkpointing": True,
        "total_tokens": 4 * 1024,
    }
    full = run(tiny(data_dir, tmp_path / "full", **bf16))
    first = run(tiny(data_dir, tmp_path / "split", stop_at_step=2, **bf16))
    second = run(tiny(data_dir, tmp_path / "split", **bf16))
    losses = [r["loss"] for r in full]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert [r["loss"] for r in first + second] == losses
    fp32 = run(tiny(data_dir, tmp_path / "fp32", total_tokens=4 * 1024, stop_at_step=1))
    assert fp32[0]["loss"] == pytest.approx(
        full[0]["loss"], rel=2e-2
    )  # bf16 compute of the same first step
    state = weights(tmp_path / "full/checkpoints" / ckpt.milestone_name(4 * 1024))
    assert all(
        t.dtype == torch.float32 for t in state.values()
    )  # fp32 master weights are what is saved


def test_validation_scores_each_held_out_token_once_however_many_rows_are_asked(tmp_path, capsys):
    """A held-out set smaller than data.val_rows is scored once, with a warning naming both counts (it was read
    again from its start, counting tokens twice); one that holds not a single row is refused before training.
    The warm-up that outlasts the run is named too."""
    from posfreq.train.data.tokens.shard_files import ShardWriter

    val_dir = tmp_path / "val"
    with ShardWriter(val_dir, "shard-000", tokenizer="bytes", vocab_size=258, eos_id=257) as w:
        for d in range(6):
            w.add(list(f"held out document {d} ".encode() * 4) + [257])
    held = TokenDataset(val_dir)
    train = tmp_path / "train"
    from posfreq.train.preflight.pretrain_check import write_tiny_corpus

    write_tiny_corpus(train)
    val = {"data.val_dir": str(val_dir), "data.val_every_tokens": 10**9, "data.val_rows": 1000}
    run(tiny(train, tmp_path / "run", total_tokens=2048, **val, **{"optim.warmup_steps": 3}))
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    scored = [r["val_targets"] for r in rows if "val_loss" in r]
    assert scored and scored[-1] <= held.num_tokens  # at most one target per held-out token
    warned = capsys.readouterr().out
    assert "fewer than data.val_rows=1000" in warned and "same tokens twice" in warned
    assert "optim.warmup_steps=3 is more than the run's 2 steps" in warned
    with pytest.raises(ConfigError, match="not one validation row of 512"):
        run(tiny(train, tmp_path / "run2", **val, **{"data.val_len": 512}))


@pytest.mark.slow
def test_validation_rows_are_built_once_per_run(data_dir, tmp_path, monkeypatch):
    """The validation rows are the same at every validation: they are planned and packed once per run (rebuilding
    them planned the held-out set's first block each time, opening each of its shards: thousands of files at a
    cluster's scale; the start-up's row count planned it once more).
    That the kept rows give the right loss is test_validation_loss_equals_a_full_logits_cross_entropy_...'s."""
    from posfreq.train.run import resolved, validation

    built = []
    real = validation.validation_sampler
    for module in (validation, resolved):  # wherever one could be made
        monkeypatch.setattr(module, "validation_sampler", lambda *a: built.append(1) or real(*a))
    val = {"data.val_dir": str(data_dir), "data.val_every_tokens": 2048, "data.val_rows": 4}
    run(tiny(data_dir, tmp_path / "run", **val))
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "val_loss" in r]) == 4
    assert (
        len(built) == 1
    )  # one sampler counts the rows at start-up and packs them at the first validation
