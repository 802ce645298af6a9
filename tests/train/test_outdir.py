"""Output directories (train/outdir.py): a command writes only where it is alone or the owner, and says so otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posfreq.train.outdir import OWNER_FILE, OutputDirError, check_output_dir, claim_output_dir


def test_a_users_folder_is_refused_by_name_and_left_untouched(tmp_path: Path) -> None:
    (tmp_path / "paper.tex").write_text("keep")
    with pytest.raises(OutputDirError, match=r"did not write \(paper.tex\)\. Fix: pass a new"):
        claim_output_dir(tmp_path, "analyze")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paper.tex"]


def test_a_new_or_empty_folder_is_claimed_and_then_reused(tmp_path: Path) -> None:
    out = claim_output_dir(tmp_path / "new", "analyze")
    assert json.loads((out / OWNER_FILE).read_text()) == {"command": "analyze"}
    (out / "histogram.npz").write_bytes(b"ours")
    assert claim_output_dir(out, "analyze") == out


def test_another_commands_folder_is_refused_with_its_owner(tmp_path: Path) -> None:
    claim_output_dir(tmp_path, "prepare")
    with pytest.raises(OutputDirError, match="holds the outputs of `posfreq prepare`"):
        check_output_dir(tmp_path, "analyze")


def test_folders_the_command_names_as_its_parts_and_owns_are_its_own(tmp_path: Path) -> None:
    """A sharded analysis writes runs/pf/shard_i, then merges into runs/pf."""
    for index in range(2):
        claim_output_dir(tmp_path / f"shard_{index}", "analyze")
    with pytest.raises(OutputDirError, match=r"\(shard_0, shard_1\)"):  # not parts unless named so
        check_output_dir(tmp_path, "analyze")
    assert claim_output_dir(tmp_path, "analyze", parts="shard_*") == tmp_path
    other = tmp_path / "other"
    claim_output_dir(other / "shard_0", "prepare")
    claim_output_dir(other / "notes", "analyze")
    with pytest.raises(OutputDirError, match=r"\(notes, shard_0\)"):
        check_output_dir(other, "analyze", parts="shard_*")


def test_a_folder_of_the_commands_outputs_is_not_an_output_of_it(tmp_path: Path) -> None:
    """`--out runs/hf` by mistake, over runs/hf/a and runs/hf/b: refused, not replaced with their loss."""
    for name in ("a", "b"):
        claim_output_dir(tmp_path / "hf" / name, "consolidate")
    with pytest.raises(OutputDirError, match=r"did not write \(a, b\)"):
        claim_output_dir(tmp_path / "hf", "consolidate")


def test_another_process_claiming_at_once_is_not_a_stranger(tmp_path: Path) -> None:
    """Array jobs claim one --out together: the owner record one of them is still writing is not a user's file."""
    (tmp_path / f".{OWNER_FILE}.a1b2c3.tmp").write_text("")
    assert claim_output_dir(tmp_path, "prepare") == tmp_path
    other = tmp_path / "other"
    other.mkdir()
    (other / ".notes.tmp").write_text("")
    with pytest.raises(OutputDirError, match=r"\.notes\.tmp"):
        check_output_dir(other, "prepare")


def test_an_older_posfreqs_output_is_recognised_only_by_the_commands_test(tmp_path: Path) -> None:
    (tmp_path / "lengths.csv").write_text("length,documents\n")
    with pytest.raises(OutputDirError):
        check_output_dir(tmp_path, "analyze", written_before=lambda path: False)
    assert check_output_dir(tmp_path, "analyze", written_before=lambda path: True) == tmp_path
    assert json.loads((tmp_path / OWNER_FILE).read_text()) == {"command": "analyze"}


def test_a_file_is_not_a_folder(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    with pytest.raises(OutputDirError, match="is a file, not a directory"):
        check_output_dir(tmp_path / "out", "analyze")


def test_a_second_process_writing_the_same_folder_is_refused_in_one_line(tmp_path):
    """Two writers of one folder: the second is refused, naming the first, until the first process ends; a
    command whose array jobs share a folder (shared=True) is not."""
    import subprocess
    import sys

    from posfreq.train.outdir import claim_output_dir, release_output_locks

    out = tmp_path / "cmp"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from posfreq.train.outdir import claim_output_dir; "
            f"claim_output_dir({str(out)!r}, 'compare'); print('claimed', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(OutputDirError, match=r"is being written by posfreq compare \(pid \d+"):
            claim_output_dir(out, "compare")
        claim_output_dir(
            out, "compare", shared=True
        )  # array jobs of one command: each its own files
    finally:
        holder.kill()
        holder.wait()
    assert claim_output_dir(out, "compare") == out  # the kernel released the dead process's lock
    assert claim_output_dir(out, "compare") == out  # this process again: its own lock
    release_output_locks()


def test_a_filesystem_without_locks_is_written_unlocked(tmp_path, monkeypatch):
    """Lustre mounted without `flock` answers ENOSYS: the command goes on as it did before locks, not crash."""
    import errno
    import fcntl

    from posfreq.train import outdir

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert outdir.claim_output_dir(tmp_path / "out", "compare") == tmp_path / "out"
    assert (tmp_path / "out" / outdir.OWNER_FILE).is_file()
