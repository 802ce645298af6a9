"""The journal of an output folder (train/journal.py): every posfreq write into a claimed folder is recorded before
the file appears, and a rerun deletes exactly what is recorded, inside the folder, never through a link."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from posfreq.train.atomic import AtomicFile, publish_dir, write_text_atomic
from posfreq.train.journal import (
    JOURNAL_FILE,
    JournalError,
    claimed_inside,
    record_written,
    recorded,
    remove_recorded,
    unrecorded,
)
from posfreq.train.outdir import OutputDirError, claim_output_dir


def test_an_atomic_write_is_recorded_before_its_file_appears(tmp_path):
    out = claim_output_dir(tmp_path / "out", "probe")
    pending = (
        AtomicFile(out / "tables" / "summary.csv") if (out / "tables").mkdir() is None else None
    )
    assert recorded(out) == ["tables/summary.csv"]  # a crash now leaves nothing unrecorded
    assert not (out / "tables" / "summary.csv").exists() and unrecorded(out) == []
    pending.discard()
    write_text_atomic(out / "a.txt", "a")
    write_text_atomic(out / "a.txt", "again")  # rewritten: one line
    assert recorded(out) == ["tables/summary.csv", "a.txt"]


def test_a_file_rewritten_every_step_adds_one_line_and_is_recorded_again_after_a_rerun(tmp_path):
    out = claim_output_dir(tmp_path / "out", "probe")
    for step in range(500):  # a probe's partial results, rewritten after each test
        write_text_atomic(out / "partial.json", str(step))
        if step % 50 == 0:
            write_text_atomic(out / "lock", "")  # another file written in between
    journal = (out / JOURNAL_FILE).read_text().splitlines()
    assert journal.count("partial.json") == 1 and journal.count("lock") == 1
    for index in range(300):  # the journal grows past the tail a record reads
        write_text_atomic(out / f"shard-{index:04d}.json", "{}")
    write_text_atomic(out / "partial.json", "late")  # far back now: recorded again, harmlessly
    assert recorded(out)[0] == "partial.json" and "shard-0299.json" in recorded(out)
    remove_recorded(out)
    assert not (out / "partial.json").exists() and recorded(out) == []
    write_text_atomic(out / "partial.json", "after the rerun")
    assert recorded(out) == ["partial.json"]  # the dropped name is recorded again


def test_a_folder_built_under_a_temporary_name_is_recorded_by_its_final_name(tmp_path):
    out = claim_output_dir(tmp_path / "run", "pretrain")
    tmp = out / "checkpoints" / "tokens-1.tmp"
    tmp.mkdir(parents=True)
    write_text_atomic(tmp / "model.safetensors", "w")
    publish_dir(tmp, out / "checkpoints" / "tokens-1")
    assert recorded(out) == ["checkpoints/tokens-1"]


def test_a_rerun_deletes_what_was_recorded_and_nothing_else(tmp_path):
    out = claim_output_dir(tmp_path / "out", "doctor")
    write_text_atomic(out / "report.json", "{}")
    data = claim_output_dir(out / "data", "prepare")  # a nested claim: recorded in the parent
    write_text_atomic(data / "shard.bin", "tokens")
    (data / "mine.txt").write_text("a user's note")  # never recorded
    outside = tmp_path / "thesis.tex"
    outside.write_text("keep me")
    link = out / "link"
    record_written(link)
    link.symlink_to(outside)  # a recorded name that is now a link: the link goes, never its target
    removed = remove_recorded(out, sub_steps=True)  # the doctor ran prepare into data/ itself
    assert sorted(p.name for p in removed) == ["link", "report.json", "shard.bin"]
    assert outside.read_text() == "keep me" and (data / "mine.txt").read_text() == "a user's note"
    assert recorded(out) == []


def test_a_rerun_never_deletes_a_neighbours_folder_claimed_inside(tmp_path):
    """An export's rerun with a probe's and loss-by-distance's results nested in it (each claimed by its own
    command) deletes the export's own files and folders, those of its own nested claims, and nothing of theirs."""
    out = claim_output_dir(tmp_path / "export", "export-hf")
    write_text_atomic(out / "model.safetensors", "weights")
    own = claim_output_dir(out / "shard", "export-hf")  # a part the export claimed itself
    write_text_atomic(own / "part.bin", "mine")
    lbd = claim_output_dir(out / "lbd", "loss-by-distance")
    write_text_atomic(lbd / "loss_by_distance.csv", "rows")
    probe = claim_output_dir(out / "runs" / "niah", "probe", shared=True)
    write_text_atomic(probe / "summary.csv", "rows")
    # what a consolidation, which replaces its --out whole, refuses to run over
    assert claimed_inside(out) == ["lbd", "runs/niah"]
    removed = remove_recorded(out)
    assert sorted(p.name for p in removed) == ["model.safetensors", "part.bin"]
    assert (lbd / "loss_by_distance.csv").read_text() == "rows"
    assert (probe / "summary.csv").read_text() == "rows"
    assert set(recorded(out)) == {"lbd", "runs/niah"} and unrecorded(out) == []
    claim_output_dir(
        out, "export-hf"
    )  # the rerun's claim: the neighbours are accounted for, not refused


def test_a_record_appended_while_a_rerun_deletes_is_kept(tmp_path, monkeypatch):
    """remove_recorded reads the journal, deletes, then drops what it deleted: a line another process (an array
    job writing the same folder) appends in between must survive, or its file would later be refused as a user's."""
    from posfreq.train import journal

    out = claim_output_dir(tmp_path / "out", "probe", shared=True)
    write_text_atomic(out / "old.json", "{}")
    write_text_atomic(out / "keep.json", "{}")
    real_inside = journal.inside

    def inside_while_another_writes(folder, name):
        if name == "old.json" and not (out / "new.json").exists():
            write_text_atomic(
                out / "new.json", "{}"
            )  # the other process, mid-way through the rerun's deletions
        return real_inside(folder, name)

    monkeypatch.setattr(journal, "inside", inside_while_another_writes)
    removed = [p.name for p in journal.remove_recorded(out, under="old.json")]
    assert removed == ["old.json"]
    assert [n for n in recorded(out) if n.endswith(".json")] == ["keep.json", "new.json"]
    assert unrecorded(out) == []


def test_a_journal_line_leading_out_of_the_folder_deletes_nothing(tmp_path):
    out = claim_output_dir(tmp_path / "out", "analyze")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "file.txt").write_text("keep")
    (out / "through").symlink_to(elsewhere)
    for line in ("../victim.txt", str(victim), "through/file.txt"):
        (out / JOURNAL_FILE).write_text(line + "\n")
        with pytest.raises(JournalError, match="nothing was deleted"):
            remove_recorded(out)
    assert victim.read_text() == "keep" and (elsewhere / "file.txt").read_text() == "keep"


def test_a_claimed_folder_holding_an_unrecorded_file_is_refused_untouched(tmp_path):
    out = claim_output_dir(tmp_path / "out", "compare")
    write_text_atomic(out / "checkpoints.csv", "a,b\n")
    (out / "notes.md").write_text("mine")
    with pytest.raises(OutputDirError, match=r"did not write \(notes.md"):
        claim_output_dir(out, "compare")
    assert (out / "notes.md").read_text() == "mine"


def _append(args):
    folder, tag = args
    for i in range(300):
        record_written(Path(folder) / f"{tag}-{i:03d}.json")


def test_two_processes_recording_at_once_lose_and_tear_no_line(tmp_path):
    out = claim_output_dir(tmp_path / "out", "probe")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_append, [(str(out), "a"), (str(out), "b")])
    lines = (out / JOURNAL_FILE).read_text().splitlines()
    assert sorted(lines) == sorted(f"{tag}-{i:03d}.json" for tag in "ab" for i in range(300))


def test_a_log_is_never_written_through_a_link_planted_at_its_name(tmp_path):
    from posfreq.train.journal import open_recorded

    out = claim_output_dir(tmp_path / "run", "pretrain")
    victim = tmp_path / "victim.txt"  # absent: a dangling link would have created it
    (out / "metrics.jsonl").symlink_to(victim)
    for mode in ("a", "w"):
        with pytest.raises(OSError):
            open_recorded(out / "metrics.jsonl", mode)
    assert not victim.exists()
    with open_recorded(out / "log.txt", "w") as f:
        f.write("one\n")
    with open_recorded(out / "log.txt", "a") as f:
        f.write("two\n")
    assert (out / "log.txt").read_text() == "one\ntwo\n" and "log.txt" in recorded(out)
