"""Checkpoint tests: atomic saves and kills mid-save, damaged files,
retention, RNG state (reading a model back: test_load.py; crafted files: test_safe_load.py; consolidation:
test_consolidate.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.trainer import (
    run,
    run_trainer_process,
    tiny,
    weights,
)

from posfreq.scripts.commands import pretrain
from posfreq.train import atomic
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint import retention
from posfreq.train.checkpoint import save as checkpoint_save
from posfreq.train.checkpoint.load import load_model
from posfreq.train.checkpoint.rng_state import capture_rng, restore_rng
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.run.config import ConfigError, config_from_dict
from posfreq.train.run.resolved import ResolvedRun

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_crash_while_writing_never_leaves_a_resumable_partial(data_dir, tmp_path, monkeypatch):
    cfg = tiny(data_dir, tmp_path, total_tokens=6 * 1024, **{"checkpoint.every_tokens": 10**9})
    real_publish = atomic.publish_dir
    calls = []

    def crashing_publish(tmp: Path, final: Path) -> None:
        calls.append(final)
        if len(calls) == 2:  # the second save dies after writing everything, before the rename
            raise KeyboardInterrupt("simulated kill")
        real_publish(tmp, final)

    monkeypatch.setattr(atomic, "publish_dir", crashing_publish)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    root = tmp_path / "checkpoints"
    assert (root / "latest.tmp" / ckpt.TRAINER_FILE).is_file()  # complete-looking, but .tmp
    assert ckpt.find_resume_checkpoint(tmp_path) == root / "latest"
    assert ckpt.read_trainer_state(root / "latest")["step"] == 2

    # A kill between the two renames of a replacement leaves `latest.old`, which is complete.
    os.replace(root / "latest", root / "latest.old")
    assert ckpt.find_resume_checkpoint(tmp_path) == root / "latest.old"
    # A half-written directory (state without trainer.json) is never picked.
    shutil.copytree(root / "latest.old", root / "tokens-000000000999999")
    (root / "tokens-000000000999999" / ckpt.TRAINER_FILE).unlink()
    assert ckpt.find_resume_checkpoint(tmp_path) == root / "latest.old"

    monkeypatch.setattr(atomic, "publish_dir", real_publish)
    history = run(cfg)  # resumes from step 2, removes the stale .tmp
    assert [r["step"] for r in history] == [3, 4, 5, 6]
    assert not (root / "latest.tmp").exists()


@pytest.mark.slow
def test_keep_full_reduces_older_milestones_to_weights(data_dir, tmp_path, capsys, monkeypatch):
    every = {"checkpoint.every_tokens": 2048, "checkpoint.latest_every_steps": 1}
    run(tiny(data_dir, tmp_path / "whole", **every))
    out = tmp_path / "kept"
    root = out / "checkpoints"
    kept = tiny(data_dir, out, **every, **{"checkpoint.keep_full": 1})
    run({**kept, "stop_at_step": 5})
    resumable = lambda: {p.name: m["resumable"] for p, m in ckpt.list_checkpoints(out)}  # noqa: E731
    name = ckpt.milestone_name
    assert resumable() == {name(2048): False, name(4096): True, ckpt.LATEST: True}
    capsys.readouterr()
    run(kept)
    assert f"resumed from {root / ckpt.LATEST} at step 5" in capsys.readouterr().out
    assert resumable() == {
        name(2048): False,
        name(4096): False,
        name(6144): False,
        name(8192): True,
        ckpt.LATEST: True,
    }
    for tokens in (2048, 4096, 6144, 8192):
        expected = weights(tmp_path / "whole/checkpoints" / name(tokens))
        model, tokenizer, meta = load_model(root / name(tokens))
        got = model.state_dict()
        assert meta["run_tokens"] == tokens and tokenizer["spec"] == "bytes"
        assert expected.keys() == got.keys() and all(
            torch.equal(expected[k], got[k]) for k in expected
        )
        np.testing.assert_array_equal(
            ckpt.load_trained_lengths(root / name(tokens)),
            ckpt.load_trained_lengths(tmp_path / "whole/checkpoints" / name(tokens)),
        )
    reduced = root / name(2048)
    assert sorted(p.name for p in reduced.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "model_config.json",
        "tokenizer_spec.json",
        "trained_lengths.npy",
        "trainer.json",
    ]
    meta = ckpt.read_trainer_state(reduced)
    ckpt.verify_checkpoint(reduced, meta)  # the manifest lists exactly what remains
    assert meta["reduced_to_weights"] and not meta["resumable"]
    with pytest.raises(ConfigError, match="holds model weights only"):
        ResolvedRun(config_from_dict({**kept, "resume": str(reduced)}), 1)
    # A kill while reducing leaves the full milestone whole (and resumable), never a half-reduced one.
    newest = root / name(8192)
    monkeypatch.setattr(
        atomic, "publish_dir", lambda tmp, final: (_ for _ in ()).throw(KeyboardInterrupt("kill"))
    )
    with pytest.raises(KeyboardInterrupt):
        retention.reduce_to_weights(newest)
    meta = ckpt.read_trainer_state(newest)
    assert meta["resumable"] and (newest / "state" / ".metadata").is_file()
    ckpt.verify_checkpoint(newest, meta)
    assert ckpt.find_resume_checkpoint(out) == newest


@pytest.fixture(scope="module")
def stopped_at_6(data_dir, tmp_path_factory) -> dict[str, Path]:
    """Runs stopped after step 6: `latest` (step 6) and the milestone tokens-4096 (step 4); sharded and full."""
    runs = {}
    for kind, sharded in (("sharded", True), ("full", False)):
        runs[kind] = tmp_path_factory.mktemp(f"stopped-{kind}")
        run(tiny(data_dir, runs[kind], stop_at_step=6, **{"checkpoint.sharded": sharded}))
    return runs


def empty(file: Path) -> None:
    file.write_bytes(b"")


def truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def delete(file: Path) -> None:
    file.unlink()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, name, damage, reason",
    [
        (
            "sharded",
            "state/__0_0.distcp",
            empty,
            r"state/__0_0\.distcp has 0 bytes, manifest\.json records \d+ ",
        ),
        (
            "sharded",
            "state/__0_0.distcp",
            flip_a_byte,
            r"state/__0_0\.distcp: its sha256 differs from manifest\.json",
        ),
        (
            "sharded",
            "rng/rank-00000.pt",
            delete,
            r"rng/rank-00000\.pt is missing \(listed in manifest\.json\)",
        ),
        ("sharded", "state/.metadata", delete, r"latest: not a complete checkpoint"),
        ("sharded", "trainer.json", empty, r"latest: not a complete checkpoint"),
        ("sharded", "manifest.json", delete, r"manifest\.json is missing"),
        (
            "full",
            "state.pt",
            truncate,
            r"state\.pt has \d+ bytes, manifest\.json records \d+ \(truncated",
        ),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_and_the_run_matches(
    stopped_at_6, uninterrupted, data_dir, tmp_path, capsys, kind, name, damage, reason
):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_6[kind], out)
    root = out / "checkpoints"
    damage(root / ckpt.LATEST / name)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"checkpoint.sharded": kind == "sharded"})))
    pretrain.main(["--config", str(config)])
    printed = capsys.readouterr().out
    skipped = next(
        line.split(" ", 2)[2] for line in printed.splitlines() if " skipped checkpoint " in line
    )
    assert skipped.startswith(f"skipped checkpoint {root / ckpt.LATEST}: ") and re.search(
        reason, skipped
    ), skipped
    assert f"resumed from {root / ckpt.milestone_name(4096)} at step 4" in printed
    final = weights(root / ckpt.milestone_name(8 * 1024))
    assert final.keys() == uninterrupted.keys() and all(
        torch.equal(final[k], uninterrupted[k]) for k in final
    )


class RankDouble:
    """Fabric's collectives as rank `rank` of a launched job sees them: broadcast gives rank 0's object whatever
    this rank passes; all_reduce adds `others_failed` (the other ranks' share) to this rank's value."""

    device = torch.device("cpu")

    def __init__(self, rank: int, rank0_sends: dict | None = None, others_failed: int = 0) -> None:
        self.global_rank, self.rank0_sends, self.others_failed = rank, rank0_sends, others_failed

    def broadcast(self, obj, src: int = 0):
        assert src == 0
        return obj if self.global_rank == 0 else self.rank0_sends

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        assert reduce_op == "sum" and tensor.device == self.device
        return tensor + self.others_failed


@pytest.mark.slow
def test_only_rank_0_reads_a_resume_checkpoints_checksums_and_every_rank_resumes_its_choice(
    stopped_at_6, data_dir, tmp_path, monkeypatch
):
    """Before launch every rank checks sizes only; after it, rank 0 hashes the chosen checkpoint once and the
    others take its verdict, here an older milestone, since the newest's bytes (not its sizes) are damaged."""
    from posfreq.train.run.resolved import agree_on_resume

    out = tmp_path / "run"
    shutil.copytree(stopped_at_6["sharded"], out)
    root = out / "checkpoints"
    flip_a_byte(root / ckpt.LATEST / "state/__0_0.distcp")
    cfg = config_from_dict(tiny(data_dir, out))
    hashed = []
    real_sha256 = ckpt.file_sha256

    def spy(path: Path) -> str:  # the weights and optimizer state, not the small manifest
        if path.name != ckpt.MANIFEST_FILE:
            hashed.append(path)
        return real_sha256(path)

    monkeypatch.setattr(ckpt, "file_sha256", spy)
    before_launch = [ResolvedRun(cfg, 2, hashes=False) for _ in range(2)]
    assert hashed == [] and all(run.resume_from == root / ckpt.LATEST for run in before_launch)

    rank0 = agree_on_resume(before_launch[0], RankDouble(0))
    assert rank0.resume_from == root / ckpt.milestone_name(4096) and hashed
    assert any("sha256 differs" in reason for reason in rank0.skipped)
    verdict = {"resume_from": str(rank0.resume_from), "skipped": rank0.skipped}
    hashed.clear()
    rank1 = agree_on_resume(before_launch[1], RankDouble(1, verdict))
    assert hashed == [] and rank1.resume_from == rank0.resume_from
    assert rank1.skipped == rank0.skipped and rank1.total_steps == rank0.total_steps

    flip_a_byte(root / ckpt.milestone_name(4096) / "state/__0_0.distcp")  # nothing left to resume
    run = ResolvedRun(cfg, 2, hashes=False)
    error = run.checksum_verdict()["error"]
    assert error.startswith("resume=auto: no checkpoint under") and "sha256 differs" in error
    with pytest.raises(CheckpointError, match="resume=auto: no checkpoint under"):
        agree_on_resume(ResolvedRun(cfg, 2, hashes=False), RankDouble(1, {"error": error}))

    # A rank that sees a checkpoint rank 0 does not raises, and so does every other rank, told by all_reduce.
    fresh = {"resume_from": None, "skipped": []}
    with pytest.raises(CheckpointError, match="rank 1 found checkpoint .* but rank 0 found none"):
        agree_on_resume(ResolvedRun(cfg, 2, hashes=False), RankDouble(1, fresh))
    rank0 = ResolvedRun(cfg, 2, hashes=False)
    rank0.resume_from = None  # as if rank 0's listing were empty
    with pytest.raises(
        CheckpointError, match="1 rank\\(s\\) could not take the checkpoint rank 0 chose"
    ):
        agree_on_resume(rank0, RankDouble(0, others_failed=1))


@pytest.mark.slow
def test_no_checkpoint_that_verifies_is_an_error_not_a_fresh_start(resumable, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    latest = out / "checkpoints" / ckpt.LATEST
    empty(latest / "state/__0_0.distcp")
    metrics = (out / "metrics.jsonl").read_text()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out)))
    with pytest.raises(SystemExit) as auto:
        pretrain.main(["--config", str(config)])
    assert str(auto.value.code).startswith(
        f"error: resume=auto: no checkpoint under {out / 'checkpoints'} can be "
        f"resumed:\n  {latest}: {latest / 'state/__0_0.distcp'} has 0 bytes"
    )
    assert "Fix: restore a good copy" in str(auto.value.code)
    with pytest.raises(SystemExit) as named:
        pretrain.main(["--config", str(config), "--resume", str(latest)])
    assert str(named.value.code).startswith(
        f"error: resume={latest}: {latest / 'state/__0_0.distcp'} has 0 bytes"
    )
    assert "Fix: restore a good copy of it, or use --resume auto" in str(named.value.code)
    assert (
        out / "metrics.jsonl"
    ).read_text() == metrics and latest.is_dir()  # nothing trained, nothing deleted


KILL_DURING_RENAME = """
import os, signal
from pathlib import Path

when, name = os.environ["KILL_AT"].split(":")  # e.g. after:latest.old = SIGKILL right after renaming onto latest.old
real_replace = os.replace


def replace(src, dst, *args, **kwargs):
    if when == "before" and Path(dst).name == name:
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)
    if when == "after" and Path(dst).name == name:
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace
from posfreq.scripts.commands import pretrain
raise SystemExit(pretrain.main())
"""


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
@pytest.mark.e2e  # a run killed mid-save and resumed
def test_sigkill_between_the_renames_of_a_save_then_resume(uninterrupted, data_dir, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(tiny(data_dir, tmp_path / "run", **{"checkpoint.every_tokens": 10**9}))
    )
    # Killed inside the second save of `latest` (step 4), just after `latest -> latest.old`.
    first = run_trainer_process(KILL_DURING_RENAME, config, KILL_AT="after:latest.old")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert (
        not (root / "latest").exists() and ckpt.read_trainer_state(root / "latest.old")["step"] == 2
    )
    # Resumed from latest.old, then killed in its next save just before `latest.tmp -> latest`: latest.old must
    # still be there (it is the only complete copy), not deleted to make room.
    second = run_trainer_process(KILL_DURING_RENAME, config, KILL_AT="before:latest")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert f"resumed from {root / 'latest.old'} at step 2" in second.stdout
    assert (
        not (root / "latest").exists() and ckpt.read_trainer_state(root / "latest.old")["step"] == 2
    )
    third = run_trainer_process(
        "from posfreq.scripts.commands import pretrain; raise SystemExit(pretrain.main())", config
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resumed from {root / 'latest.old'} at step 2" in third.stdout
    assert "taking over a stale lock" in third.stderr  # the killed process could not release it
    final = weights(root / ckpt.milestone_name(8 * 1024))
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)
    assert sorted(p.name for p in root.iterdir()) == ["latest", ckpt.milestone_name(8 * 1024)]


def test_cuda_rng_is_saved_per_rank_device_and_restores_on_a_node_of_another_size(monkeypatch):
    """Each rank drives one GPU: its state alone is saved, and an older all-GPU list restores this rank's entry
    (not an IndexError on a node with fewer GPUs)."""
    set_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8)
    )
    monkeypatch.setattr(
        torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved by one rank")
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": set_calls.append(state.tolist())
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda states: pytest.fail("restores every GPU")
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    state = capture_rng()
    assert state["cuda_device"].tolist() == [7]
    restore_rng(state)
    older = {
        **{k: v for k, v in state.items() if k != "cuda_device"},
        "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(8)],
    }
    restore_rng(older)  # saved on 8 GPUs, restored by rank 1 of a smaller node
    assert set_calls == [[7], [1]]


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_named_as_such(data_dir, tmp_path, monkeypatch):
    """safetensors words a short write as 'unexpected pos 704 vs 598': the error must say the disk is full."""
    import shutil
    from collections import namedtuple

    def short_write(*args, **kwargs):
        raise RuntimeError("unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_save, "save_checkpoint", short_write)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 4096, 4096))
    with pytest.raises(
        SystemExit,
        match=r"error: saving .*latest failed: the disk holding .* is full \(0 MiB free\) "
        r"\(RuntimeError: unexpected pos 704 vs 598\)\. Fix: free space",
    ):
        config = tmp_path / "run.json"
        config.write_text(json.dumps(tiny(data_dir, tmp_path / "run", stop_at_step=1)))
        pretrain.main(["--config", str(config)])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    with pytest.raises(
        RuntimeError, match="unexpected pos"
    ):  # with room on the disk, the error is not reworded
        run(tiny(data_dir, tmp_path / "other", stop_at_step=1))


def test_an_unreadable_file_is_a_damaged_checkpoint_named_in_manifest_order(
    stopped_at_6, tmp_path, monkeypatch
):
    """Files are hashed at once: the first bad one in the manifest's order is named, and an I/O error (EIO on a
    failing disk) is a CheckpointError, which --resume auto skips, not an OSError that ends the resume."""
    import errno

    out = tmp_path / "run"
    shutil.copytree(stopped_at_6["sharded"], out)
    latest = out / "checkpoints" / ckpt.LATEST
    meta = ckpt.read_trainer_state(latest)
    names = list(json.loads((latest / "manifest.json").read_text())["files"])
    real = ckpt.file_sha256

    def failing(path: Path) -> str:
        if path.name == Path(names[-1]).name:
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(ckpt, "file_sha256", failing)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot be read \(Input/output error\)"):
        ckpt.verify_checkpoint(latest, meta)
    flip_a_byte(latest / names[0])  # an earlier file is damaged too: it is the one named
    with pytest.raises(ckpt.CheckpointError, match=re.escape(names[0]) + ": its sha256 differs"):
        ckpt.verify_checkpoint(latest, meta)
