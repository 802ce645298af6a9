"""The main job in miniature: the paper's probing experiment on a 2-core CPU.

    python scripts/demo.py            # full: about 30 minutes on 2 cores
    python scripts/demo.py --quick    # every stage at toy scale, a few minutes (CI runs it)

Stages, each one of the project's own commands (REPORT.md lists them exactly):
1. the demo tokenizer and corpora (scripts/demo_corpus.py): a warm-up corpus of copy drills and
   a main corpus of NIAH-format documents on half of the Paul Graham essays, with skewed
   lengths; the probe uses the other half and needle numbers kept out of training;
2. the main corpus's length histogram and f(i) at both training lengths (Fig. 1 / Fig. 3 analogues);
3. token shards (scripts/prepare_data.py);
4. a short warm-up run on the copy drills (an induction circuit must exist before retrieval can
   be learned), then two models continued from it at L = 256 and L = 512 with the same data,
   seed, model and token budget (train/pretrain.py --model.init_from), milestone checkpoints
   carrying trained-length histograms;
5. the NIAH probe of every checkpoint with rope and with string (analysis/probe.py);
6. Fig. 2a / 2b (analysis/effective_length.py), a Table 1-style comparison of position schemes
   at the training length, and REPORT.md with an honest reading of the numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from analysis.effective_length import find_run_results, read_csv  # noqa: E402
from train.checkpoint import MILESTONE_PREFIX, list_checkpoints  # noqa: E402
from train.cli import code_version  # noqa: E402


@dataclass(frozen=True)
class DemoSettings:
    """Everything that sizes the demo; the full and quick modes differ only here."""

    train_lens: tuple[int, ...]
    corpus_docs: int
    warmup_docs: int
    warmup_tokens: int
    total_tokens: int
    checkpoint_every_tokens: int
    global_batch_tokens: int
    probe_start: int
    probe_step: int
    tests_per_length: int
    table1_tests: int
    table1_schemes: tuple[str, ...]
    seed: int = 0
    answer_budget: int = 20  # tokens for the answer inside each test length: the 4 numbers take 15 + EOS here


FULL = DemoSettings(
    train_lens=(256, 512), corpus_docs=30_000, warmup_docs=15_000, warmup_tokens=614_400,
    total_tokens=2_457_600, checkpoint_every_tokens=614_400,
    global_batch_tokens=1024, probe_start=128, probe_step=32, tests_per_length=40, table1_tests=100,
    table1_schemes=("rope", "string", "rerope", "self_extend", "dca", "ntk", "yarn"),
)
QUICK = DemoSettings(
    train_lens=(256, 512), corpus_docs=2_000, warmup_docs=500, warmup_tokens=16_384,
    total_tokens=98_304, checkpoint_every_tokens=32_768,
    global_batch_tokens=1024, probe_start=128, probe_step=128, tests_per_length=4, table1_tests=4,
    table1_schemes=("rope", "string"),
)


class Pipeline:
    """Runs the project's commands, printing and recording each; each command's output goes to OUT/logs.

    Independent branches (the two training lengths) run side by side, one thread of torch each:
    on a 2-core machine that uses both cores without the oversubscription that makes two
    multi-threaded processes crawl.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.commands: list[tuple[str, str, float]] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def run(self, stage: str, *args: str | Path) -> None:
        cmd = [sys.executable, *map(str, args)]
        shown = " ".join(shlex.quote(str(a)) for a in ["python", *cmd[1:]])
        log = self.logs / ("".join(c if c.isalnum() else "_" for c in stage).strip("_") + ".log")
        print(f"== {stage}: started (log: {log})\n   $ {shown}", flush=True)
        start = time.perf_counter()
        with log.open("w") as sink:
            result = subprocess.run(cmd, cwd=REPO, env=self.env, stdout=sink, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        self.commands.append((stage, shown, seconds))
        if result.returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise SystemExit(f"{tail}\ndemo: stage '{stage}' failed (exit {result.returncode}); the command was:\n"
                             f"  {shown}\nIts full output is in {log}. Fix the error and rerun `python scripts/demo.py` "
                             "(finished training and probing are reused).")
        print(f"== {stage}: done in {seconds:.0f} s", flush=True)

    def parallel(self, jobs: dict[int, Callable[[], object]]) -> dict[int, object]:
        """Run independent jobs side by side; returns their results by key (re-raises the first failure)."""
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = {key: pool.submit(job) for key, job in jobs.items()}
            return {key: future.result() for key, future in futures.items()}


def probe_options(settings: DemoSettings) -> list[str]:
    """Probe flags shared by every demo probe: the answer budget, the training answers' needle order, and
    --replace-stale (a rerun after a code change re-probes instead of stopping at the old results)."""
    return ["--max-new-tokens", str(settings.answer_budget), "--answer-order", "nearest_first", "--replace-stale",
            "--threads", "1"]


def probe_lengths(settings: DemoSettings, train_len: int) -> list[int]:
    return list(range(settings.probe_start, train_len + 1, settings.probe_step))


def last_milestone(run: Path) -> Path:
    """The run's newest complete token-milestone checkpoint (never `latest`, never a half-written .tmp)."""
    return [path for path, _ in list_checkpoints(run) if path.name.startswith(MILESTONE_PREFIX)][-1]


def train(p: Pipeline, settings: DemoSettings, stage: str, data: Path, run: Path, train_len: int, tokens: int,
          *extra: str | Path) -> Path:
    """One train/pretrain.py run of the demo config; returns its last milestone checkpoint."""
    p.run(stage, "train/pretrain.py", "--config", "configs/demo.yaml", "--data.dir", data,
          "--data.seq_len", str(train_len), "--out_dir", run, "--total_tokens", str(tokens),
          "--global_batch_tokens", str(settings.global_batch_tokens),
          "--checkpoint.every_tokens", str(min(tokens, settings.checkpoint_every_tokens)),
          "--seed", str(settings.seed), *extra)
    return last_milestone(run)


def train_and_probe(p: Pipeline, settings: DemoSettings, corpus: Path, data: Path, warm: Path, train_len: int) -> Path:
    """Continue the warm-up model at `train_len`, then probe every milestone with rope and string."""
    run = p.out / f"L{train_len}"
    train(p, settings, f"train L={train_len}", data, run, train_len, settings.total_tokens, "--model.init_from", warm)
    for scheme in ("rope", "string"):
        out = run / ("probe" if scheme == "rope" else f"probe-{scheme}")
        p.run(f"probe L={train_len} ({scheme})", "analysis/probe.py", "--run", run, "--positions", scheme,
              "--haystack", corpus / "probe_haystack", "--lengths", ",".join(map(str, probe_lengths(settings, train_len))),
              "--tests-per-length", str(settings.tests_per_length), "--out", out, "--seed", str(settings.seed),
              *probe_options(settings))
    return run


def table1(p: Pipeline, settings: DemoSettings, corpus: Path, run: Path, train_len: int) -> list[dict]:
    """Pass rate at the training length of the run's last checkpoint, per position scheme."""
    final = last_milestone(run)
    rows = []
    for scheme in settings.table1_schemes:
        out = run / "table1" / scheme
        p.run(f"table 1 L={train_len} ({scheme})", "analysis/probe.py", "--checkpoint", final, "--positions", scheme,
              "--haystack", corpus / "probe_haystack", "--lengths", str(train_len),
              "--tests-per-length", str(settings.table1_tests), "--out", out, "--seed", str(settings.seed + 1),
              "--no-figures", *probe_options(settings))
        summary = read_csv(out / "summary.csv")[0]
        rows.append({"scheme": scheme, "pass_rate": float(summary["pass_rate"]),
                     "needle_recall": float(summary["needle_recall"]), "tests": int(summary["n_tests"])})
    return rows


def markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None or value == "":
        return "–"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def best_pass_rate(run: Path) -> float:
    """The highest pass rate any checkpoint of the run reached at any length (rope and string probes)."""
    best = 0.0
    for table in run.glob("probe*/effective_length.csv"):
        for row in read_csv(table):
            best = max([best] + [float(v) for k, v in row.items() if k.startswith("pass_rate_") and v != ""])
    return best


def write_report(out: Path, settings: DemoSettings, quick: bool, pipeline: Pipeline, runs: dict[int, Path],
                 table: dict[int, list[dict]]) -> Path:
    """REPORT.md: what ran, what came out, and what it does and does not show."""
    lines = [
        f"# posfreq demo report{' (quick mode: toy scale, not a result)' if quick else ''}",
        "",
        f"Code version `{code_version()}`; settings: `{json.dumps(asdict(settings))}`.",
        "",
        "## Effective length per checkpoint",
        "",
    ]
    for train_len, run in runs.items():
        for probe_dir in sorted(run.glob("probe*")):
            rows = read_csv(find_run_results(probe_dir) / "effective_length.csv")
            cols = ["tokens_seen", "tokens_this_run", "positions", "effective_length", "effective_length_lo",
                    "effective_length_hi", "effective_length_status", "f_effective_length", "tf_effective_length"]
            cols += [c for c in rows[0] if c.startswith("pass_rate_")]
            lines += [f"### L = {train_len}, {probe_dir.name}", "", markdown(rows, cols), ""]
    lines += ["## Table 1 analogue: pass rate at the training length, last checkpoint", ""]
    for train_len, rows in table.items():
        lines += [f"### L = {train_len}", "", markdown(rows, ["scheme", "pass_rate", "needle_recall", "tests"]), ""]
    best = max(best_pass_rate(run) for run in runs.values())
    lines += ["## Figures", ""]
    for figure in sorted((out / "figures").glob("*.png")):
        lines.append(f"![{figure.stem}](figures/{figure.name})")
    finals = {n: read_csv(run / "probe" / "effective_length.csv")[-1] for n, run in runs.items()}
    lines += ["", "## What this shows and what it does not", "", reading(best, quick, finals), "", "## Commands", ""]
    lines += [f"- {stage} ({seconds:.0f} s): `{cmd}`" for stage, cmd, seconds in pipeline.commands]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def reading(best: float, quick: bool, finals: dict[int, dict]) -> str:
    """An honest paragraph on what the numbers can support; `finals` is each run's last rope row."""
    if quick:
        return ("Quick mode trains for seconds: it checks that every stage runs and writes its outputs. "
                "Its numbers mean nothing.")
    if best < 0.5:
        return (f"The miniature models did not learn needle retrieval well enough to measure an effective "
                f"length: the best pass rate of any checkpoint at any length was {best:.2f} (a length passes at "
                f">= 0.50). Every stage ran, and the curves above are what was measured; the paper's "
                f"finding is not reproduced here. See the README's notes on the demo for what was tried.")
    measured = "; ".join(f"L = {n}: effective length {row['effective_length']} ({row['effective_length_status']}), "
                         f"f(effective length) = {row['f_effective_length'] or 'undefined'}" for n, row in finals.items())
    return (f"The models learned retrieval, so effective lengths are measured. Last checkpoints (rope): {measured}. "
            "The paper predicts that the longer training length reaches a given effective length with fewer "
            "tokens (Fig. 2a) and that the runs coincide when effective length is plotted against f (Fig. 2b); "
            "read both figures against that. With one seed, two 0.9M-parameter models, retrieval that emerges "
            "abruptly between milestones and a few dozen tests per length (a step of the curve is within noise), "
            "this illustrates the pipeline; it is not evidence at the paper's scale (1.3B parameters, 1T tokens, "
            "500 tests per length).")


def publish_figures(out: Path) -> None:
    """Copy the headline figures to docs/figures for the README (full mode only)."""
    target = REPO / "docs" / "figures"
    target.mkdir(parents=True, exist_ok=True)
    for png in (out / "figures").glob("*.png"):
        shutil.copy2(png, target / png.name)


def collect_figures(out: Path, runs: dict[int, Path]) -> None:
    """Gather the figures the report shows into OUT/figures."""
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for png in (out / "position_freq" / "figures").glob("fig*.png"):
        shutil.copy2(png, figures / png.name)
    for train_len, run in runs.items():
        last = sorted((run / "probe").glob("tokens-*"))[-1]
        for png in (last / "figures").glob("*.png"):
            shutil.copy2(png, figures / f"L{train_len}_{png.name}")


def validate(out: Path, runs: dict[int, Path]) -> None:
    """The quick mode's acceptance check: outputs exist and parse, >= 3 probed checkpoints per run."""
    problems = []
    for train_len, run in runs.items():
        for probe in ("probe", "probe-string"):
            table = run / probe / "effective_length.csv"
            if not table.is_file():
                problems.append(f"missing {table}")
                continue
            rows = read_csv(table)
            if len(rows) < 3:
                problems.append(f"{table}: {len(rows)} probed checkpoints, need >= 3")
    for name in ("REPORT.md", "position_freq/summary.json"):
        if not (out / name).is_file():
            problems.append(f"missing {out / name}")
    json.loads((out / "position_freq" / "summary.json").read_text())
    pngs = list((out / "figures").glob("*.png"))
    if len(pngs) < 4:
        problems.append(f"only {len(pngs)} figures in {out / 'figures'}")
    if problems:
        raise SystemExit("demo: outputs incomplete:\n  " + "\n  ".join(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy scale, a few minutes: checks that every stage runs")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/demo or runs/demo-quick)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    out = (args.out or REPO / "runs" / ("demo-quick" if args.quick else "demo")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    p = Pipeline(out)
    start = time.perf_counter()

    corpus = out / "corpus"
    lengths = sorted({n for L in settings.train_lens for n in probe_lengths(settings, L)} | set(settings.train_lens))
    p.run("demo tokenizer and corpora", "scripts/demo_corpus.py", "--out", corpus, "--docs", str(settings.corpus_docs),
          "--warmup-docs", str(settings.warmup_docs), "--probe-lengths", *map(str, lengths),
          "--probe-tests", str(max(settings.tests_per_length, settings.table1_tests)),
          "--probe-seeds", str(settings.seed), str(settings.seed + 1))
    tokenizer = f"hf:{corpus / 'tokenizer'}"
    main_corpus = corpus / "main" / "demo_corpus.jsonl"
    p.run("length histogram and f(i)", "analysis/position_freq.py", "--corpus", main_corpus,
          "--tokenizer", tokenizer, "--train-len", *map(str, settings.train_lens),
          "--budget-tokens", str(settings.total_tokens), "--out", out / "position_freq", "--quiet")
    for name, path in (("warmup", corpus / "warmup" / "warmup.jsonl"), ("main", main_corpus)):
        p.run(f"token shards ({name})", "scripts/prepare_data.py", "--corpus", path, "--tokenizer", tokenizer,
              "--out", out / "data" / name)
    warm = train(p, settings, "warm-up (copy drills)", out / "data" / "warmup", out / "warmup",
                 min(settings.train_lens), settings.warmup_tokens)
    runs = p.parallel({n: functools.partial(train_and_probe, p, settings, corpus, out / "data" / "main", warm, n)
                       for n in settings.train_lens})
    p.run("Fig. 2a / 2b / 3", "analysis/effective_length.py", *[runs[n] / "probe" for n in settings.train_lens],
          "--out", out / "figures")
    table = p.parallel({n: functools.partial(table1, p, settings, corpus, runs[n], n) for n in settings.train_lens})
    collect_figures(out, runs)
    report = write_report(out, settings, args.quick, p, runs, table)
    if args.quick:
        validate(out, runs)
    else:
        publish_figures(out)
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s; report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
