"""`posfreq checkpoint consolidate`: one safetensors file the probe and export load, written only where it may."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.records import as_older_posfreq
from helpers.trainer import (
    run,
    tiny,
)

from posfreq.scripts.commands import checkpoint as checkpoint_command
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.consolidate import consolidate
from posfreq.train.checkpoint.load import load_model, model_state_dict, verify_before_reading
from posfreq.train.checkpoint.safe_load import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_consolidate_and_load_model(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, total_tokens=2048))
    src = tmp_path / "checkpoints" / ckpt.milestone_name(2048)
    out = consolidate(src, tmp_path / "model")
    assert sorted(p.name for p in out.iterdir()) == [
        ".posfreq-files",
        ".posfreq-lock",
        ".posfreq-output.json",
        "manifest.json",
        "meta.json",
        "model.safetensors",
        "model_config.json",
        "tokenizer_spec.json",
        "trained_lengths.npy",
    ]
    m1, tok, meta = load_model(src)
    m2, tok2, meta2 = load_model(out, dtype=torch.float32)
    # the tokenizer by spec and by content (the probe and export refuse one whose files changed since)
    expected = {
        "spec": "bytes",
        "vocab_size": 258,
        "bos_id": 256,
        "eos_id": 257,
        "fingerprint": "bytes",
    }
    assert tok == tok2 == expected
    assert meta["run_tokens"] == meta2["run_tokens"] == 2048
    ids = torch.arange(40) % 258
    torch.testing.assert_close(m1(ids), m2(ids), rtol=0, atol=0)
    assert m1.generate(ids[None, :8], 4) == m2.generate(ids[None, :8], 4)


def snapshot(root: Path) -> dict:
    """Every file under `root` with its bytes (directories implied): to prove a refused command changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_consolidate_never_replaces_a_directory_it_did_not_write(data_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(tiny(data_dir, run_dir, total_tokens=2048))
    src = run_dir / "checkpoints" / ckpt.milestone_name(2048)
    (
        tmp_path / "model.old"
    ).mkdir()  # a user's directories that happen to sit where publish() would work
    (tmp_path / "model.old" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    for out in (run_dir, tmp_path / "model"):
        with pytest.raises(
            SystemExit,
            match="error: --out.* (holds files `posfreq checkpoint consolidate` did not write|holds "
            "the outputs of `posfreq pretrain`).*nothing was changed",
        ):
            checkpoint_command.main(["consolidate", "--checkpoint", str(src), "--out", str(out)])
        assert snapshot(tmp_path) == before
    (tmp_path / "model.old" / "notes.txt").unlink()
    (tmp_path / "model.old").rmdir()
    first = consolidate(src, tmp_path / "model")
    again = consolidate(src, tmp_path / "model")  # its own: replaced whole
    assert (
        first == again
        and (again / "model.safetensors").is_file()
        and not (tmp_path / "model.old").exists()
    )
    as_older_posfreq(again)  # as an older posfreq left it: its files, meta.json naming the source
    (again / "manifest.json").unlink()  # older consolidations had no manifest of their own
    assert (
        checkpoint_command.main(
            ["consolidate", "--checkpoint", str(src), "--out", str(again), "--dtype", "bf16"]
        )
        == 0
    )
    with pytest.raises(
        CheckpointError, match="nope is not a directory"
    ):  # a wrong --checkpoint writes nothing, not even the temporary
        consolidate(run_dir / "nope", tmp_path / "other")
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.tmp").exists()


def test_damaged_weights_are_refused_before_they_are_read(data_dir, tmp_path, capsys):
    """Reading a checkpoint's weights (consolidation, export, the probe, init_from) checks its files against its
    manifest first: a flipped byte or a truncated shard is one error naming the file, never weights silently used
    nor DCP's traceback. A checkpoint from before manifests that fails to read says so in one line too."""
    import re
    import shutil

    from posfreq.scripts.commands import export_hf

    run(tiny(data_dir, tmp_path / "run", total_tokens=2048))
    src = tmp_path / "run" / "checkpoints" / ckpt.milestone_name(2048)
    for damage in ("flip", "truncate", "truncate, no manifest"):
        copy = tmp_path / damage
        shutil.copytree(src, copy)
        shard = max((copy / ckpt.STATE_DIR).glob("*.distcp"), key=lambda p: p.stat().st_size)
        data = shard.read_bytes()
        if damage == "flip":
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        else:
            data = data[: len(data) // 10]
        shard.write_bytes(data)
        named = re.escape(str(shard))
        if damage.endswith("no manifest"):
            state = json.loads((copy / ckpt.TRAINER_FILE).read_text())
            del state["manifest_sha256"]
            (copy / ckpt.TRAINER_FILE).write_text(json.dumps(state))
            named = re.escape(str(copy / ckpt.STATE_DIR)) + ": cannot be read"
        with pytest.raises(CheckpointError, match=named):
            model_state_dict(copy)
        for command, argv in (
            (
                checkpoint_command,
                ["consolidate", "--checkpoint", str(copy), "--out", str(tmp_path / "c")],
            ),
            (export_hf, ["--checkpoint", str(copy), "--out", str(tmp_path / "e")]),
        ):
            with pytest.raises(SystemExit) as refused:
                command.main(argv)
            assert re.match(f"error: .*{named}.*Fix: ", str(refused.value.code)), refused.value.code
        assert not (tmp_path / "c").exists() and not (tmp_path / "e").exists()
    intact = consolidate(src, tmp_path / "intact")  # the undamaged checkpoint still reads
    meta = json.loads((intact / ckpt.META_FILE).read_text())
    assert (
        meta["source_manifest_sha256"]
        == json.loads((src / ckpt.TRAINER_FILE).read_text())["manifest_sha256"]
    )
    model_state_dict(intact)  # a consolidation carries its own manifest, checked on every read
    intact = Path(
        shutil.copytree(intact, tmp_path / "intact-copy")
    )  # verified once per process and path
    weights_file = intact / ckpt.CONSOLIDATED_WEIGHTS
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(
        CheckpointError, match=re.escape(str(weights_file)) + ": its sha256 differs"
    ):
        model_state_dict(intact)
    (
        intact / "manifest.json"
    ).unlink()  # as a consolidation from before manifests: nothing to check against
    assert set(model_state_dict(intact)) == set(model_state_dict(src))


def test_a_checkpoint_resealed_while_it_is_verified_is_checked_again_not_called_damaged(
    data_dir, tmp_path, monkeypatch
):
    """A probe reading a milestone while the run's retention reduces it to weights meets a new manifest half-way:
    it verifies again under the new one instead of reporting damage; a real mismatch is still reported."""
    from posfreq.train.checkpoint import load as checkpoint_load
    from posfreq.train.checkpoint.retention import reduce_to_weights
    from posfreq.train.checkpoint.safe_load import CheckpointError

    run(tiny(data_dir, tmp_path / "run", total_tokens=2048))
    src = tmp_path / "run" / "checkpoints" / ckpt.milestone_name(2048)
    real, calls = ckpt.verify_checkpoint, []

    def resealed_during_the_first_check(path, meta, hashes=True):
        calls.append(meta["manifest_sha256"])
        if len(calls) == 1:
            reduce_to_weights(path)  # what retention does meanwhile
            raise CheckpointError(
                f"{path}/manifest.json differs from the one trainer.json records (damaged)"
            )
        return real(path, meta, hashes)

    monkeypatch.setattr(checkpoint_load, "verify_checkpoint", resealed_during_the_first_check)
    verify_before_reading(src)
    assert (
        calls[-1] != calls[0]
    )  # checked again, under the new manifest (retention checked the old one too)
    monkeypatch.setattr(
        checkpoint_load,
        "verify_checkpoint",
        lambda *a, **k: (_ for _ in ()).throw(CheckpointError("x: damaged")),
    )
    copy = Path(shutil.copytree(src, tmp_path / "copy"))
    with pytest.raises(CheckpointError, match="x: damaged. Fix: "):
        verify_before_reading(copy)


def blocked_on_a_lock(pid: int) -> bool:
    """Whether process `pid` waits for a file lock, as /proc/locks lists waiters ("->")."""
    return any(
        "->" in line and f" {pid} " in line for line in Path("/proc/locks").read_text().splitlines()
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/locks").is_file(), reason="needs Linux's /proc/locks")
def test_a_consolidation_touches_out_tmp_only_once_it_holds_the_lock_beside_out(data_dir, tmp_path):
    """Each of two concurrent consolidations deleted OUT.tmp before taking its lock, destroying the other's work in
    progress. Now the lock beside --out comes first: while another process holds it (here, this test, with a
    consolidation's OUT.tmp half written), a second consolidation waits and leaves OUT.tmp alone; then it runs,
    and OUT ends whole and checked."""
    import subprocess
    import sys
    import time

    from posfreq.train.checkpoint.consolidate import CONSOLIDATE
    from posfreq.train.outdir import claim_output_dir, lock_beside, release_output_locks

    run(tiny(data_dir, tmp_path, total_tokens=2048))
    src = tmp_path / "checkpoints" / ckpt.milestone_name(2048)
    out = tmp_path / "CO"
    code = "import sys; from posfreq.train.checkpoint.consolidate import consolidate; consolidate(*sys.argv[1:])"
    with lock_beside(out):
        in_progress = claim_output_dir(tmp_path / "CO.tmp", CONSOLIDATE)
        (in_progress / "model.safetensors").write_bytes(b"half written")
        release_output_locks()
        second = subprocess.Popen([sys.executable, "-c", code, str(src), str(out)])
        deadline = time.monotonic() + 120
        while not blocked_on_a_lock(
            second.pid
        ):  # the kernel lists a blocked flock as a waiter ("->")
            assert second.poll() is None, (
                "the second consolidation ran without waiting for the lock"
            )
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert (in_progress / "model.safetensors").read_bytes() == b"half written"
    assert second.wait(120) == 0
    assert not (tmp_path / "CO.tmp").exists()
    model, _, _ = load_model(out, dtype=torch.float32)  # the manifest is checked on load
    reference, _, _ = load_model(src)
    ids = torch.arange(20) % 258
    torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)
