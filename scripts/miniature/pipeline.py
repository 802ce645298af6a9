"""The demo's stages as the project's own commands: the lanes that run them and each stage's command line (what
sizes them: settings.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from posfreq.analysis.niah import store
from posfreq.analysis.table_files import read_csv
from posfreq.scripts.miniature.settings import DemoSettings
from posfreq.train.checkpoint.layout import MILESTONE_PREFIX, list_checkpoints
from posfreq.train.journal import open_recorded
from posfreq.train.run.parallel import local_launch_env

REPO = Path(__file__).resolve().parents[2]


class DemoError(RuntimeError):
    """A demo stage or check that failed: the message says which, and where its log is (the command exits)."""


class Pipeline:
    """Runs the project's commands, printing and recording each; each command's output goes to OUT/logs.

    Jobs run in `lanes` lanes with `threads` torch threads each (OMP_NUM_THREADS is forced). The default, two
    lanes of one thread, uses both cores of a 2-core machine without the oversubscription that slows two
    multi-threaded processes tens of times; one lane of two threads is the same work under another thread setting.
    """

    def __init__(self, out: Path, lanes: int = 2, threads: int = 1) -> None:
        self.out = out
        self.lanes = lanes
        self.threads = threads
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.commands: list[tuple[str, str, float]] = []
        # Each command starts its own rendezvous: two lanes must not share a port an outer job left set.
        self.env = {**local_launch_env(os.environ), "OMP_NUM_THREADS": str(threads)}

    def run(self, stage: str, *args: str | Path) -> None:
        cmd = [sys.executable, *map(str, args)]
        shown = " ".join(shlex.quote(str(a)) for a in ["python", *cmd[1:]])
        log = self.logs / ("".join(c if c.isalnum() else "_" for c in stage).strip("_") + ".log")
        say(f"== {stage}: started (log: {log})\n   $ {shown}")
        start = time.perf_counter()
        with open_recorded(log, "w") as sink:
            process = subprocess.Popen(
                cmd, cwd=REPO, env=self.env, stdout=sink, stderr=subprocess.STDOUT
            )
            while True:  # a line a minute while it runs: a long stage is never silent
                try:
                    returncode = process.wait(timeout=HEARTBEAT_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    say(
                        f"   {stage}: running, {time.perf_counter() - start:.0f} s; {last_line(log)}"
                    )
        seconds = time.perf_counter() - start
        self.commands.append((stage, shown, seconds))
        if returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise DemoError(
                f"{tail}\ndemo: stage '{stage}' failed (exit {returncode}); the command was:\n"
                f"  {shown}\nIts full output is in {log}. Fix the error and rerun `python scripts/demo.py` "
                "(finished training and probing are reused)."
            )
        say(f"== {stage}: done in {seconds:.0f} s")

    def parallel(self, jobs: dict[int, Callable[[], object]]) -> dict[int, object]:
        """Run independent jobs side by side; returns their results by key (re-raises the first failure)."""
        with ThreadPoolExecutor(max_workers=min(len(jobs), self.lanes)) as pool:
            futures = {key: pool.submit(job) for key, job in jobs.items()}
            return {key: future.result() for key, future in futures.items()}


HEARTBEAT_SECONDS = 60.0


def say(text: str) -> None:
    """Print whole lines in one write: the lanes' threads never interleave within a line."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def last_line(log: Path) -> str:
    """The last non-empty line a stage's log holds so far (a progress bar's latest state), shortened."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:120] if lines else "no output yet"


def probed_lengths(settings: DemoSettings, train_len: int) -> list[int]:
    """The NIAH test lengths n <= train_len a run of that length is probed at."""
    return [n for n in settings.test_lengths if n <= train_len]


def last_milestone(run: Path) -> Path:
    """The run's newest complete token-milestone checkpoint (never `latest`, never a half-written .tmp)."""
    return [path for path, _ in list_checkpoints(run) if path.name.startswith(MILESTONE_PREFIX)][-1]


def analyze_command(
    settings: DemoSettings, corpus: Path, tokenizer: str, out: Path
) -> list[str | Path]:
    """The analysis/position_freq.py command line: the corpus's length histogram and f(i) at both training lengths."""
    return [
        "analysis/position_freq.py",
        "--corpus",
        corpus,
        "--tokenizer",
        tokenizer,
        "--train-len",
        *map(str, settings.train_lens),
        "--total-tokens",
        str(settings.total_tokens),
        "--out",
        out,
        "--quiet",
    ]


def shards_command(corpus: Path, tokenizer: str, out: Path) -> list[str | Path]:
    """The scripts/prepare_data.py command line that tokenizes one demo corpus into token shards."""
    return [
        "scripts/prepare_data.py",
        "--corpus",
        corpus,
        "--tokenizer",
        tokenizer,
        "--out",
        out,
    ]


def train_command(
    settings: DemoSettings,
    data: Path,
    run: Path,
    train_len: int,
    tokens: int,
    seed: int,
    *extra: str | Path,
) -> list[str | Path]:
    """The train/pretrain.py command line of one run of the demo config (one row per micro-batch where the
    config's two rows would exceed the global batch)."""
    rows = settings.global_batch_tokens // train_len
    micro = ("--micro-batch-rows", str(max(1, rows))) if rows < 2 else ()
    return [
        "train/pretrain.py",
        "--config",
        "configs/demo.yaml",
        "--data.dir",
        data,
        "--data.train-len",
        str(train_len),
        "--out",
        run,
        "--total-tokens",
        str(tokens),
        "--global-batch-tokens",
        str(settings.global_batch_tokens),
        "--checkpoint.every-tokens",
        str(min(tokens, settings.checkpoint_every_tokens)),
        "--seed",
        str(seed),
        *micro,
        *extra,
    ]


def validation_flags(p: Pipeline, settings: DemoSettings) -> tuple[str, ...]:
    """The trainer flags that validate a run on the held-out corpus's shards at every milestone (the loss by
    distance that analysis/compare.py draws and tests against f): rows of the longest training length for every
    run, so all runs score the same tokens at each distance."""
    length = max(settings.train_lens)
    rows = max(1, settings.val_tokens // length)
    flags = ("--data.val-dir", str(p.out / "data" / "validation"), "--data.val-rows", str(rows))
    return (*flags, "--data.val-len", str(length))


def train(
    p: Pipeline,
    settings: DemoSettings,
    stage: str,
    data: Path,
    run: Path,
    train_len: int,
    tokens: int,
    seed: int,
    *extra: str | Path,
) -> Path:
    """One train/pretrain.py run of the demo config; returns its last milestone checkpoint."""
    p.run(stage, *train_command(settings, data, run, train_len, tokens, seed, *extra))
    return last_milestone(run)


def probe_command(
    settings: DemoSettings,
    corpus: Path,
    lengths: list[int],
    tests: int,
    seed: int,
    out: Path,
    *source: str | Path,
    threads: int = 1,
) -> list[str | Path]:
    """The analysis/probe.py command line at test lengths `lengths`, with the demo's answer budget and the
    training answers' needle order.

    --replace-stale: a rerun after a code change probes again instead of stopping at the old results.
    --tokenizer: the demo tokenizer where it is now (the probe checks it by content against each checkpoint's
    record), so a rerun of a demo folder that moved probes its checkpoints, which name the folder they trained in.
    """
    return [
        "analysis/probe.py",
        *source,
        "--tokenizer",
        f"hf:{corpus / 'tokenizer'}",
        "--haystack",
        corpus / "probe_haystack",
        "--lengths",
        ",".join(map(str, lengths)),
        "--max-new-tokens",
        str(settings.answer_budget),
        "--answer-order",
        "nearest_first",
        "--tests-per-length",
        str(tests),
        "--out",
        out,
        "--seed",
        str(seed),
        "--replace-stale",
        "--threads",
        str(threads),
    ]


def probe(
    p: Pipeline,
    settings: DemoSettings,
    corpus: Path,
    stage: str,
    lengths: list[int],
    tests: int,
    seed: int,
    out: Path,
    *source: str | Path,
) -> None:
    """Run the probe (`probe_command`) as one stage."""
    p.run(
        stage,
        *probe_command(settings, corpus, lengths, tests, seed, out, *source, threads=p.threads),
    )


def train_and_probe(
    p: Pipeline,
    settings: DemoSettings,
    corpus: Path,
    data: Path,
    warm: Future,
    seed: int,
    train_len: int,
) -> Path:
    """Continue seed `seed`'s warm-up model at `train_len`, then probe every milestone (rope; string too for
    the seeds in settings.string_seeds). The probe's tests are the same for every seed (probe seed 0)."""
    run = p.out / f"L{train_len}-s{seed}"
    train(
        p,
        settings,
        f"train L={train_len} seed={seed}",
        data,
        run,
        train_len,
        settings.total_tokens,
        seed,
        "--model.init-from",
        warm.result(),
        *validation_flags(p, settings),
    )
    for scheme in ("rope", "string") if seed in settings.string_seeds else ("rope",):
        out = run / ("probe" if scheme == "rope" else f"probe-{scheme}")
        probe(
            p,
            settings,
            corpus,
            f"probe L={train_len} seed={seed} ({scheme})",
            probed_lengths(settings, train_len),
            settings.tests_per_length,
            0,
            out,
            "--run",
            run,
            "--positions",
            scheme,
        )
    return run


def prepare_inputs(p: Pipeline, settings: DemoSettings) -> Path:
    """Stages 1-3: the demo tokenizer and corpora, the main corpus's f(i), and token shards of the three corpora
    under OUT/data/{warmup,main,validation}; returns the corpus directory (its tokenizer, corpora and probe haystack)."""
    corpus = p.out / "corpus"
    lengths = sorted(
        {n for L in settings.train_lens for n in probed_lengths(settings, L)}
        | set(settings.train_lens)
    )
    p.run(
        "demo tokenizer and corpora",
        "scripts/miniature/corpus.py",
        "--out",
        corpus,
        "--docs",
        str(settings.corpus_docs),
        "--warmup-docs",
        str(settings.warmup_docs),
        "--probe-lengths",
        *map(str, lengths),
        "--probe-tests",
        str(max(settings.tests_per_length, settings.table1_tests)),
        "--probe-seeds",
        "0",
        "1",
        "--val-docs",
        str(settings.val_docs),
    )
    tokenizer = f"hf:{corpus / 'tokenizer'}"
    main_corpus = corpus / "main" / "demo_corpus.jsonl"
    p.run(
        "length histogram and f(i)",
        *analyze_command(settings, main_corpus, tokenizer, p.out / "position_freq"),
    )
    for name, path in (
        ("warmup", corpus / "warmup" / "warmup.jsonl"),
        ("main", main_corpus),
        ("validation", corpus / "validation" / "validation.jsonl"),
    ):
        p.run(f"token shards ({name})", *shards_command(path, tokenizer, p.out / "data" / name))
    return corpus


def warm_ups(p: Pipeline, settings: DemoSettings, pool: ThreadPoolExecutor) -> dict[int, Future]:
    """Queue every seed's warm-up run on the copy drills; each future gives its last milestone checkpoint."""
    return {
        s: pool.submit(
            train,
            p,
            settings,
            f"warm-up seed={s}",
            p.out / "data" / "warmup",
            p.out / f"warmup-s{s}",
            settings.warmup_len,
            settings.warmup_tokens,
            s,
        )
        for s in settings.seeds
    }


def table1(
    p: Pipeline, settings: DemoSettings, corpus: Path, run: Path, train_len: int
) -> list[dict]:
    """Pass rate at the training length of the run's last checkpoint, per position scheme, over the same tests:
    each with its Wilson interval, and every scheme's paired difference from rope with its interval and the exact
    McNemar test, Holm-adjusted over the schemes (analysis/tables/paper_tables.py)."""
    from posfreq.analysis.tables.paper_tables import outcomes_by_test
    from posfreq.analysis.tables.paper_tables import table1 as paired_table

    final = last_milestone(run)
    recall, outcomes = {}, {}
    for scheme in settings.table1_schemes:
        out = run / "table1" / scheme
        probe(
            p,
            settings,
            corpus,
            f"table 1 L={train_len} ({scheme})",
            [train_len],
            settings.table1_tests,
            1,
            out,
            "--checkpoint",
            final,
            "--positions",
            scheme,
            "--no-figures",
        )
        recall[scheme] = float(read_csv(out / store.SUMMARY_FILE)[0]["needle_recall"])
        outcomes[scheme] = outcomes_by_test(store.read_records(out, [train_len]), "greedy")
    rows = paired_table(outcomes, baseline=settings.table1_schemes[0])
    return [{**row, "needle_recall": recall[row["scheme"]]} for row in rows]


def strict_comparison(
    p: Pipeline, settings: DemoSettings, runs: dict[str, Path]
) -> tuple[Path, dict]:
    """The verdicts under the stricter criterion (settings.strict_min_retrieved of 4 needles): each run's tables
    re-derived from its stored per-test records into OUT/strict-kof4/figures/<run>/probe (analysis/effective_length.py,
    no decoding; the probe's own tables keep the paper's criterion) and compared (analysis/compare.py).
    Returns the comparison's directory and its conclusion."""
    k = settings.strict_min_retrieved
    base = p.out / f"strict-{k}of4"
    p.run(
        f"effective length, {k} of 4 needles",
        "analysis/effective_length.py",
        *[run / "probe" for run in runs.values()],
        "--min-retrieved",
        str(k),
        "--out",
        base / "figures",
    )
    p.run(
        f"compare runs, {k} of 4 needles",
        "analysis/compare.py",
        *[base / "figures" / run.name for run in runs.values()],
        "--out",
        base / "compare",
    )
    return base / "compare", json.loads((base / "compare" / "conclusion.json").read_text())
