"""Every command that writes its --out alone takes that folder's lock before it creates, reuses or deletes anything
there or beside it (issue #46, item 5: "Locks before temporaries").

For export-hf, analyze, compare, effective-length, loss-by-distance, doctor and demo, in-process through the
`posfreq` dispatcher: a first run writes --out; another process then holds OUT/.posfreq-lock as a running posfreq
would; a second run into the same --out is refused with one `error:` line naming the holder and the fix, and
nothing else (it is refused when it first looks at --out, before its slow work), and the
whole tmp tree (every path's size and mtime, --out's siblings included) is as it was; once the holder is gone the
same command runs again. Concurrent consolidations (a lock beside --out, which waits instead of refusing) are
tested in tests/train/checkpoint/test_consolidate.py; the shared claimers (prepare, pretrain, probe, ruler, table)
lock their parts or run, not --out, and are tested with those.

Two commands are made cheap without weakening what is checked, as both claim --out before any work: doctor's checks
are replaced by a stand-in that writes its tiny corpus into OUT/data (so a rerun has an earlier run's part to
remove, after the lock), and demo runs with --threads 0, refused right after the claim (a real demo takes minutes):
its "success" is that refusal instead of the lock's.

A rerun never deletes a neighbour's nested results (issue #46, item 2): for export-hf, probe, table, ruler,
loss-by-distance, effective-length, compare, analyze, checkpoint consolidate and pretrain --overwrite, another
command's results written inside --out between two runs are left as they were, bytes and mtimes, while the rerun
rewrites its own (a consolidation, which replaces --out whole, is refused instead, naming them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from helpers.cli import outcome
from helpers.hf import consolidated_bytes_model, save_tiny_hf
from helpers.probe import tiny_model, write_checkpoint

from posfreq.train.journal import LOCK_FILE, unrecorded

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

HOLDER = textwrap.dedent(
    """
    import fcntl, os, socket, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)  # the lock file the first run left; never created here
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.write(fd, f"posfreq held-by-test (pid {os.getpid()} on {socket.gethostname()})".encode())
    print("held", flush=True)
    time.sleep(600)
    """
)
"""A stand-in for another posfreq writing --out: holds its lock, as `train/outdir.py`'s `_lock` does, until killed."""


@contextmanager
def held(out: Path) -> Iterator[subprocess.Popen]:
    """Another process holding `out`'s lock for the block (killed after it)."""
    lock = out / LOCK_FILE
    assert lock.is_file(), f"the first run left no {lock}"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held", "the holder did not take the lock"
        yield holder
    finally:
        holder.kill()
        holder.wait(30)
        holder.stdout.close()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` (hidden ones, folders and `root` itself included): its size and mtime in ns. A file
    or folder created, deleted, rewritten or renamed under `root` changes it."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in [root, *sorted(root.rglob("*"))]
    }


# Each case builds its inputs in tmp_path and returns (argv, --out, whether an unlocked run's outcome is success).
Case = Callable[[Path, pytest.MonkeyPatch], tuple[list[str], Path, Callable[[int, str], bool]]]


def succeeded(code: int, err: str) -> bool:
    return code == 0


def export_hf(tmp: Path, monkeypatch) -> tuple:
    consolidated_bytes_model(tmp / "model")
    out = tmp / "hf"
    return ["export-hf", "--checkpoint", str(tmp / "model"), "--out", str(out)], out, succeeded


def analyze(tmp: Path, monkeypatch) -> tuple:
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp / "cache"))
    corpus = tmp / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": "ab " * n}) + "\n" for n in (3, 9, 20)))
    out = tmp / "pf"
    argv = ["analyze", "--corpus", str(corpus), "--tokenizer", "bytes", "--workers", "1"]
    argv += ["--quiet", "--train-len", "16", "--packing", "best_fit", "--no-figures"]
    return [*argv, "--out", str(out)], out, succeeded


def probed_run(run: Path, seed: int) -> Path:
    """A probed run as `posfreq probe --run` leaves it (checkpoints' config.json, RUN/probe's tables)."""
    from posfreq.analysis.table_files import write_csv

    rows = []
    for k in (1, 2):
        (run / "checkpoints" / f"tokens-{k}").mkdir(parents=True)
        (run / "checkpoints" / f"tokens-{k}" / "config.json").write_text(
            json.dumps({"seed": seed, "data": {}})
        )
        rows.append(
            {
                "checkpoint": f"tokens-{k}",
                "positions": "rope",
                "train_len": 128,
                "tokens_trained": 1000 * k,
                "effective_length": 32 * k,
                "effective_length_status": "ok",
                **{f"pass_rate_{n}": float(n <= 32 * k) for n in (32, 64, 96, 128)},
            }
        )
    (run / "probe").mkdir()
    (run / "probe" / "probe.json").write_text(json.dumps({"run": ""}))
    write_csv(run / "probe" / "effective_length.csv", rows)
    return run / "probe"


def compare(tmp: Path, monkeypatch) -> tuple:
    runs = [str(probed_run(tmp / f"s{seed}", seed)) for seed in (0, 1)]
    out = tmp / "cmp"
    return ["compare", *runs, "--out", str(out), "--no-figures"], out, succeeded


def effective_length(tmp: Path, monkeypatch) -> tuple:
    probe = (
        Path(__file__).parent / "fixtures" / "demo_probe" / "L256-s0" / "probe"
    )  # read, never written
    out = tmp / "eff"
    return ["effective-length", str(probe), "--out", str(out)], out, succeeded


def loss_by_distance(tmp: Path, monkeypatch) -> tuple:
    from posfreq.train.preflight.pretrain_check import write_tiny_corpus

    data = write_tiny_corpus(tmp / "shards", max_words=20)
    checkpoint = write_checkpoint(
        tmp / "run", 4096, tiny_model(), np.bincount([3, 60], minlength=513)
    )
    out = tmp / "lbd"
    argv = ["loss-by-distance", "--checkpoint", str(checkpoint), "--data", str(data)]
    return [*argv, "--rows", "2", "--train-len", "64", "--out", str(out)], out, succeeded


def doctor(tmp: Path, monkeypatch) -> tuple:
    from posfreq.scripts.commands import doctor as command
    from posfreq.train.preflight.checks import CheckResult
    from posfreq.train.preflight.pretrain_check import write_tiny_corpus

    def stand_in(out: Path, device, expect_gpu: bool = True) -> list[CheckResult]:
        write_tiny_corpus(out / "data", max_words=5)  # as run_doctor's first stage
        return [CheckResult("environment", "PASS", "stand-in", 0.0, None, "-")]

    monkeypatch.setattr(command, "run_doctor", stand_in)
    out = tmp / "doc"
    return ["doctor", "--device", "cpu", "--out", str(out)], out, succeeded


def demo(tmp: Path, monkeypatch) -> tuple:
    out = tmp / "demo"

    def past_the_claim(code: int, err: str) -> bool:
        return code != 0 and "--threads 0" in err and "is being written by" not in err

    return ["demo", "--threads", "0", "--out", str(out)], out, past_the_claim


CASES: list[Case] = [export_hf, analyze, compare, effective_length, loss_by_distance, doctor, demo]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="flock")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.replace("_", "-"))
def test_a_second_writer_of_one_out_is_refused_before_anything_is_touched(
    case: Case, tmp_path, monkeypatch, capsys
):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(
        work
    )  # anything written relative to the current directory lands in the snapshot too
    argv, out, ran = case(work, monkeypatch)
    code, err = outcome(argv, capsys)
    assert ran(code, err), f"the first run: exit {code}\n{err}"
    with held(out) as holder:
        before = tree(work)
        code, err = outcome(argv, capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code != 0, f"a second writer ran while another held {out}\n{err}"
        assert "Traceback" not in err and len(errors) == 1, err
        # refused at its first look at --out, before its slow work (a corpus read, a model loaded): the error is
        # all the user reads
        assert [line for line in err.splitlines() if line.strip()] == errors, err
        assert "is being written by posfreq held-by-test" in errors[0], err
        assert f"pid {holder.pid} " in errors[0] and "Fix:" in errors[0], err
        after = tree(work)
        changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
        assert not changed, f"the refused run touched {changed}"
    code, err = outcome(argv, capsys)
    assert ran(code, err), f"the run after the holder ended: exit {code}\n{err}"


def probe(tmp: Path, monkeypatch) -> tuple:
    checkpoint = write_checkpoint(
        tmp / "run", 1024, tiny_model(), np.bincount([512], minlength=513)
    )
    out = tmp / "niah"
    argv = ["probe", "--checkpoint", str(checkpoint), "--lengths", "512", "--tests-per-length", "1"]
    argv += ["--haystack", "noise", "--max-new-tokens", "40", "--quiet", "--no-figures"]
    return [*argv, "--out", str(out)], out, succeeded


def table(tmp: Path, monkeypatch) -> tuple:
    model = save_tiny_hf(tmp / "hf")
    out = tmp / "table"
    argv = ["table", "--model", f"hf:{model}", "--schemes", "rope", "--niah-lengths", "448"]
    argv += ["--tests", "1", "--haystack", "noise", "--max-new-tokens", "40", "--bootstrap", "1"]
    return [*argv, "--out", str(out)], out, succeeded


def ruler(tmp: Path, monkeypatch) -> tuple:
    pytest.importorskip("lm_eval", reason="the lmeval extra: pip install -e '.[lmeval]'")
    pytest.importorskip("wonderwords", reason="lm-eval's ruler extra: pip install -e '.[lmeval]'")
    model = save_tiny_hf(tmp / "hf")
    out = tmp / "ruler"
    argv = ["ruler", "--model", f"hf:{model}", "--tasks", "niah_single_1", "--samples", "1"]
    return [*argv, "--out", str(out)], out, succeeded  # at the trained length, 768


def consolidate(tmp: Path, monkeypatch) -> tuple:
    checkpoint = write_checkpoint(
        tmp / "run", 1024, tiny_model(), np.bincount([512], minlength=513)
    )
    out = tmp / "model"
    argv = ["checkpoint", "consolidate", "--checkpoint", str(checkpoint)]
    return [*argv, "--out", str(out)], out, succeeded


def pretrain(tmp: Path, monkeypatch) -> tuple:
    from helpers.trainer import tiny

    from posfreq.train.preflight.pretrain_check import write_tiny_corpus

    data = write_tiny_corpus(tmp / "shards", max_words=20)
    out = tmp / "run"
    config = (
        tmp / "pretrain.json"
    )  # one step; resume null: the rerun with --overwrite starts afresh
    config.write_text(json.dumps(tiny(data, out, total_tokens=1024, resume=None)))
    return ["pretrain", "--config", str(config)], out, succeeded


def with_out(argv: list[str], out: Path) -> list[str]:
    """`argv` with `out` as its --out."""
    at = argv.index("--out") + 1
    return [*argv[:at], str(out), *argv[at + 1 :]]


def identity(path: Path) -> tuple[int, int]:
    """(inode, mtime in ns): a file rewritten, in place or by an atomic replace, changes it."""
    return path.stat().st_ino, path.stat().st_mtime_ns


def nesting(
    case: Case,
    rewritten: str,
    rerun: tuple = (),
    refused: bool = False,
    inside: str = "neighbour",
    slow: bool = False,
):
    """One command that may hold another command's results inside its --out: its case, a file of its own that its
    rerun rewrites, what the rerun adds to its command line, whether the rerun is refused instead, and where in
    its --out the neighbour writes."""
    marks = [pytest.mark.slow] if slow else []
    values = (case, rewritten, list(rerun), refused, inside)
    return pytest.param(*values, id=case.__name__.replace("_", "-"), marks=marks)


NESTING = [
    nesting(export_hf, "model.safetensors"),
    nesting(probe, "summary.csv"),
    nesting(table, "table1.csv"),
    nesting(ruler, "scores.csv", slow=True),  # lm-eval's RULER tasks take ~20 s to import
    nesting(loss_by_distance, "loss_by_distance.csv"),
    nesting(effective_length, "fig2a_effective_length_vs_tokens.png"),
    nesting(compare, "conclusion.json"),
    nesting(analyze, "summary.json"),
    # a consolidation replaces --out whole (train/atomic.py's publish_dir): it refuses to run over a neighbour
    nesting(consolidate, "model.safetensors", refused=True),
    # inside the folder --overwrite empties
    nesting(pretrain, "metrics.jsonl", ("--overwrite", "true"), inside="checkpoints/neighbour"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, rewritten, rerun, refused, inside", NESTING)
def test_a_rerun_never_deletes_a_neighbours_results_nested_in_its_out(
    case: Case,
    rewritten: str,
    rerun: list[str],
    refused: bool,
    inside: str,
    tmp_path,
    monkeypatch,
    capsys,
):
    """Issue #46, item 2: a command runs into OUT; another posfreq command (analyze, or compare for analyze itself)
    then writes a folder inside OUT; the first command's rerun touches none of the neighbour's files (bytes and
    mtime) and rewrites its own, or it is refused with one `error:` line naming the neighbour and nothing changed."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv, out, ran = case(work, monkeypatch)
    code, err = outcome(argv, capsys)
    assert ran(code, err), f"the first run: exit {code}\n{err}"
    own = identity(out / rewritten)
    neighbour = out / inside
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    with pytest.MonkeyPatch.context() as patch:  # its settings (analyze's cache) are its own
        other, _, other_ran = (compare if case is analyze else analyze)(inputs, patch)
        code, err = outcome(with_out(other, neighbour), capsys)
    assert other_ran(code, err), f"the neighbour's run: exit {code}\n{err}"
    theirs = tree(neighbour)
    assert len(theirs) > 3, theirs
    before = tree(work)
    code, err = outcome([*argv, *rerun], capsys)
    if refused:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code != 0 and "Traceback" not in err and len(errors) == 1, err
        assert str(neighbour) in errors[0] and "Fix:" in errors[0], err
        after = tree(work)
        changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
        assert not changed, f"the refused rerun touched {changed}"
    else:
        assert code == 0, f"the rerun: exit {code}\n{err}"
        assert identity(out / rewritten) != own, f"the rerun did not rewrite {out / rewritten}"
        assert unrecorded(out) == [], "the neighbour is no longer accounted for in OUT's journal"
    assert tree(neighbour) == theirs, "the rerun changed the neighbour's results"
