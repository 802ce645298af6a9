"""The main job in miniature: the paper's probing experiment on a 2-core CPU, over three seeds.

    python scripts/demo.py            # full (times: docs/performance.md)
    python scripts/demo.py --quick    # every stage at toy scale (CI runs it)

Stages, each one of the project's own commands (REPORT.md lists them exactly):
1. the demo tokenizer and corpora (scripts/demo_corpus.py): a warm-up corpus of copy drills and
   a main corpus of NIAH-format documents on half of the Paul Graham essays, with skewed
   lengths; the probe uses the other half and needle numbers kept out of training;
2. the main corpus's length histogram and f(i) at both training lengths (Fig. 1 / Fig. 3 analogues);
3. token shards (scripts/prepare_data.py);
4. per seed, a warm-up run on the copy drills at L = 128 (an induction circuit must exist before
   retrieval can be learnt), then two models continued from it at L = 256 and L = 512 with the
   same data, model and token budget (train/pretrain.py --model.init-from); the seed sets the
   model init and the data order. Two single-thread lanes run the trainings (every warm-up first,
   then the continued runs, longest first). Milestone checkpoints carry trained-length histograms;
5. the NIAH probe of every milestone with rope (and with string for the first seed): a test of
   length n is an (n - 18)-token prompt and at most 18 new tokens (the 16-token answer and EOS fit);
6. analysis/compare.py over all runs: Fig. 2a / 2b with seed bands, pass-rate curves of every
   milestone, and the computed verdicts (shortfall, longer L reaches further, the paper's C2);
   the same verdicts under a stricter pass criterion (3 of 4 needles instead of the paper's 2),
   re-derived from the stored per-test records of copies of the probe directories (no decoding);
   a Table 1-style comparison of position schemes at the training length; REPORT.md.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

from jsonargparse import ArgumentParser

REPO = Path(__file__).resolve().parents[1]

from posfreq.analysis.effective_length import read_csv  # noqa: E402
from posfreq.scripts.demo_agreement import agreement, agreement_lines, checkpoints_of  # noqa: E402
from posfreq.train.checkpoint import MILESTONE_PREFIX, list_checkpoints  # noqa: E402
from posfreq.train.cli import code_version, command_parser, parse  # noqa: E402
from posfreq.train.outdir import OutputDirError, claim_output_dir, entry_names  # noqa: E402


@dataclass(frozen=True)
class DemoSettings:
    """Everything that sizes the demo; the full and quick modes differ only here."""

    train_lens: tuple[int, ...]
    seeds: tuple[int, ...]  # one warm-up per seed, every training length continued from it
    corpus_docs: int
    warmup_docs: int
    warmup_len: int
    warmup_tokens: int
    total_tokens: int
    checkpoint_every_tokens: int
    global_batch_tokens: int
    test_lengths: tuple[
        int, ...
    ]  # NIAH test lengths n (prompt + answer budget); a run is probed at those <= L
    tests_per_length: int
    table1_tests: int
    table1_schemes: tuple[str, ...]
    answer_budget: int = 18  # B: the 4-number answer is 16 demo-tokenizer tokens, then EOS
    string_seeds: tuple[int, ...] = (0,)  # seeds whose milestones are also probed with STRING
    strict_min_retrieved: int = (
        3  # the second pass criterion the verdicts are recomputed under (the paper's: 2 of 4)
    )


FULL = DemoSettings(
    train_lens=(256, 512),
    seeds=(0, 1, 2),
    corpus_docs=30_000,
    warmup_docs=20_000,
    warmup_len=128,
    warmup_tokens=819_200,
    total_tokens=2_457_600,
    checkpoint_every_tokens=307_200,
    global_batch_tokens=1024,
    test_lengths=(144, 176, 208, 256, 320, 384, 448, 512),
    tests_per_length=32,
    table1_tests=50,
    table1_schemes=("rope", "string", "rerope", "self_extend", "dca", "ntk", "yarn"),
)
QUICK = DemoSettings(
    train_lens=(256, 512),
    seeds=(0,),
    corpus_docs=2_000,
    warmup_docs=500,
    warmup_len=128,
    warmup_tokens=16_384,
    total_tokens=98_304,
    checkpoint_every_tokens=32_768,
    global_batch_tokens=1024,
    test_lengths=(144, 256, 512),
    tests_per_length=4,
    table1_tests=4,
    table1_schemes=("rope", "string"),
)


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
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def run(self, stage: str, *args: str | Path) -> None:
        cmd = [sys.executable, *map(str, args)]
        shown = " ".join(shlex.quote(str(a)) for a in ["python", *cmd[1:]])
        log = self.logs / ("".join(c if c.isalnum() else "_" for c in stage).strip("_") + ".log")
        print(f"== {stage}: started (log: {log})\n   $ {shown}", flush=True)
        start = time.perf_counter()
        with log.open("w") as sink:
            result = subprocess.run(
                cmd, cwd=REPO, env=self.env, stdout=sink, stderr=subprocess.STDOUT
            )
        seconds = time.perf_counter() - start
        self.commands.append((stage, shown, seconds))
        if result.returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise SystemExit(
                f"{tail}\ndemo: stage '{stage}' failed (exit {result.returncode}); the command was:\n"
                f"  {shown}\nIts full output is in {log}. Fix the error and rerun `python scripts/demo.py` "
                "(finished training and probing are reused)."
            )
        print(f"== {stage}: done in {seconds:.0f} s", flush=True)

    def parallel(self, jobs: dict[int, Callable[[], object]]) -> dict[int, object]:
        """Run independent jobs side by side; returns their results by key (re-raises the first failure)."""
        with ThreadPoolExecutor(max_workers=min(len(jobs), self.lanes)) as pool:
            futures = {key: pool.submit(job) for key, job in jobs.items()}
            return {key: future.result() for key, future in futures.items()}


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
        "--budget-tokens",
        str(settings.total_tokens),
        "--out",
        out,
        "--quiet",
    ]


def shards_command(corpus: Path, tokenizer: str, out: Path) -> list[str | Path]:
    """The scripts/prepare_data.py command line that tokenizes one demo corpus into token shards."""
    return ["scripts/prepare_data.py", "--corpus", corpus, "--tokenizer", tokenizer, "--out", out]


def train_command(
    settings: DemoSettings,
    data: Path,
    run: Path,
    train_len: int,
    tokens: int,
    seed: int,
    *extra: str | Path,
) -> list[str | Path]:
    """The train/pretrain.py command line of one run of the demo config."""
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
        *extra,
    ]


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
    """
    return [
        "analysis/probe.py",
        *source,
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
    """Stages 1-3: the demo tokenizer and corpora, the main corpus's f(i), and token shards of both corpora under
    OUT/data/{warmup,main}; returns the corpus directory (its tokenizer, corpora and probe haystack)."""
    corpus = p.out / "corpus"
    lengths = sorted(
        {n for L in settings.train_lens for n in probed_lengths(settings, L)}
        | set(settings.train_lens)
    )
    p.run(
        "demo tokenizer and corpora",
        "scripts/demo_corpus.py",
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
    )
    tokenizer = f"hf:{corpus / 'tokenizer'}"
    main_corpus = corpus / "main" / "demo_corpus.jsonl"
    p.run(
        "length histogram and f(i)",
        *analyze_command(settings, main_corpus, tokenizer, p.out / "position_freq"),
    )
    for name, path in (("warmup", corpus / "warmup" / "warmup.jsonl"), ("main", main_corpus)):
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
    """Pass rate at the training length of the run's last checkpoint, per position scheme."""
    final = last_milestone(run)
    rows = []
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
        summary = read_csv(out / "summary.csv")[0]
        rows.append(
            {
                "scheme": scheme,
                "pass_rate": float(summary["pass_rate"]),
                "needle_recall": float(summary["needle_recall"]),
                "tests": int(summary["n_tests"]),
            }
        )
    return rows


def strict_comparison(
    p: Pipeline, settings: DemoSettings, runs: dict[str, Path]
) -> tuple[Path, dict]:
    """The verdicts under the stricter criterion (settings.strict_min_retrieved of 4 needles): each run's probe
    directory is copied (the originals keep the paper's criterion), its tables re-derived from the stored per-test
    records (analysis/effective_length.py, no decoding) and compared (analysis/compare.py).
    Returns the comparison's directory and its conclusion."""
    k = settings.strict_min_retrieved
    base = p.out / f"strict-{k}of4"
    copies = []
    for name, run in runs.items():
        copy = base / name / "probe"
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(run / "probe", copy)
        copies.append(copy)
    p.run(
        f"effective length, {k} of 4 needles",
        "analysis/effective_length.py",
        *copies,
        "--min-retrieved",
        str(k),
        "--out",
        base / "figures",
    )
    p.run(
        f"compare runs, {k} of 4 needles", "analysis/compare.py", *copies, "--out", base / "compare"
    )
    return base / "compare", json.loads((base / "compare" / "conclusion.json").read_text())


def markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def verdicts(conclusion: dict, quick: bool) -> list[str]:
    """REPORT.md's conclusion: each computed verdict with the numbers and the test behind it."""
    if quick:
        return [
            "Quick mode trains for seconds: it checks that every stage runs and writes its outputs. "
            "Its verdicts below are computed like the full demo's but mean nothing."
        ]
    lines = []
    for name in ("shortfall", "longer_reaches_further", "curves_coincide"):
        c = conclusion[name]
        holds = {True: "**holds**", False: "**does not hold**", None: "**not testable**"}[
            c["holds"]
        ]
        detail = ""
        if "last_checkpoints" in c:
            detail = (
                " Last checkpoints: "
                + "; ".join(
                    f"L = {x['train_len']} seed {x['seed']}: {x['effective_length']} ({x['status']}, interval up to "
                    f"{x['effective_length_hi']})"
                    for x in c["last_checkpoints"]
                )
                + "."
            )
        if "interval_95" in c:
            value = c.get("D_log10_f", c.get("mean_difference"))
            detail = f" Estimate {value:.3f}, 95% interval [{c['interval_95'][0]:.3f}, {c['interval_95'][1]:.3f}]."
        if c.get("censored") and any(c["censored"].values()):
            detail += (
                f" Censored runs (every probed length passed, so the value is a lower bound capped by L) per "
                f"length: {c['censored']}."
            )
        if "reason" in c:
            detail = (
                f" Not testable because there are {c['reason']}: {c.get('n_points')} points with a defined, "
                "uncensored effective length per training length."
            )
        test = f" Test: {c['test']}." if "test" in c else ""
        lines.append(f"- {c['claim']}: {holds}.{detail}{test}")
    return lines


CPU_KERNEL_OVERRIDES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")
"""Environment variables that make torch, MKL and oneDNN use narrower vector kernels (an older CPU's rounding)."""


def machine_description() -> str:
    """The CPU and the torch kernels a run used: its rounding, and so its training trajectories, depend on both."""
    import torch

    cpu = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    overrides = ", ".join(
        f"{name}={os.environ[name]}" for name in CPU_KERNEL_OVERRIDES if name in os.environ
    )
    return (
        f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.backends.cpu.get_cpu_capability()} "
        f"kernels" + (f" ({overrides})" if overrides else "")
    )


def write_report(
    out: Path,
    settings: DemoSettings,
    quick: bool,
    pipeline: Pipeline,
    runs: dict[str, Path],
    table: dict[int, list[dict]],
    conclusion: dict,
    strict: dict,
    references: list[dict] | None = None,
) -> Path:
    """REPORT.md: what ran, what came out (computed verdicts with their numbers), every command."""
    lines = [
        f"# posfreq demo report{' (quick mode: toy scale, not a result)' if quick else ''}",
        "",
        f"Code version `{code_version()}`; settings: `{json.dumps(asdict(settings))}`; {pipeline.lanes} lane(s) of "
        f"{pipeline.threads} torch thread(s) (OMP_NUM_THREADS={pipeline.threads}); machine: {machine_description()}.",
        "",
        f"A test of length n is a prompt of n - {settings.answer_budget} tokens and at most "
        f"{settings.answer_budget} generated tokens, so no token is generated at a position >= n. "
        "Token counts include the warm-up (`tokens_seen`).",
        "",
        "## Conclusion (computed by analysis/compare.py; numbers in compare/conclusion.json)",
        "",
        "A test passes when its answer holds at least 2 of its 4 needles (the paper's criterion).",
        "",
        *verdicts(conclusion, quick),
        "",
        f"### The same under a stricter criterion: at least {settings.strict_min_retrieved} of 4 needles",
        "",
        f"Re-derived from the same per-test records, no decoding (strict-{settings.strict_min_retrieved}of4/compare/"
        "conclusion.json). The k-th nearest needle sets how far a test must reach, so a stricter k measures "
        "retrieval farther from the question.",
        "",
        *verdicts(strict, quick),
        "",
        *[line for reference in references or [] for line in agreement_lines(reference)],
        "## When each run learnt retrieval",
        "",
        markdown(
            conclusion["emergence"],
            ["train_len", "seed", "checkpoints", "first_retrieval_tokens", "share_of_budget"],
        ),
        "",
        "## Effective length per checkpoint (95% bootstrap interval over tests)",
        "",
    ]
    cols = [
        "tokens_seen",
        "effective_length",
        "effective_length_lo",
        "effective_length_hi",
        "effective_length_status",
        "f_effective_length",
        "tf_effective_length",
    ]
    for name, run in runs.items():
        for probe_dir in sorted(d for d in run.glob("probe*") if d.is_dir()):
            rows = read_csv(probe_dir / "effective_length.csv")
            shown = cols + [c for c in rows[0] if c.startswith("pass_rate_")]
            lines += [f"### {name}, {probe_dir.name}", "", markdown(rows, shown), ""]
    lines += [
        f"## Table 1 analogue: pass rate at the training length, last checkpoint (seed {settings.seeds[0]})",
        "",
    ]
    for train_len, rows in table.items():
        lines += [
            f"### L = {train_len}",
            "",
            markdown(rows, ["scheme", "pass_rate", "needle_recall", "tests"]),
            "",
        ]
    lines += ["## Figures", ""]
    lines += [
        f"![{figure.stem}](figures/{figure.name})"
        for figure in sorted((out / "figures").glob("*.png"))
    ]
    lines += ["", "## Commands", ""]
    lines += [f"- {stage} ({seconds:.0f} s): `{cmd}`" for stage, cmd, seconds in pipeline.commands]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def publish_figures(out: Path) -> None:
    """Replace docs/figures with this run's figures for the README (full mode, in a checkout): none left from an
    older run. An installed posfreq has no docs/ to publish to; the figures stay in OUT/figures."""
    if not (REPO / "docs").is_dir():
        print(f"not a checkout (no {REPO / 'docs'}): the figures stay in {out / 'figures'}")
        return
    target = REPO / "docs" / "figures"
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.glob("*.png"):
        stale.unlink()
    for png in (out / "figures").glob("*.png"):
        shutil.copy2(png, target / png.name)


def collect_figures(
    out: Path, runs: dict[str, Path], first_seed: int, extra: dict[str, Path]
) -> None:
    """Gather the figures the report shows into OUT/figures: f(i), the comparison, the first seed's heatmaps, and
    those of each `extra` directory, prefixed with its name."""
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for png in [
        *(out / "position_freq" / "figures").glob("fig*.png"),
        *(out / "compare" / "figures").glob("*.png"),
    ]:
        shutil.copy2(png, figures / png.name)
    for prefix, directory in extra.items():
        for png in directory.glob("*.png"):
            shutil.copy2(png, figures / f"{prefix}_{png.name}")
    for name, run in runs.items():
        if name.endswith(f"-s{first_seed}"):
            last = sorted((run / "probe").glob("tokens-*"))[-1]
            for png in (last / "figures").glob("*.png"):
                shutil.copy2(png, figures / f"{name}_{png.name}")


def validate(out: Path, runs: dict[str, Path], settings: DemoSettings) -> None:
    """The quick mode's acceptance check: outputs exist and parse, >= 3 probed checkpoints per run."""
    problems = []
    for name, run in runs.items():
        seed = int(name.rsplit("-s", 1)[1])
        for probe_name in (
            ("probe", "probe-string") if seed in settings.string_seeds else ("probe",)
        ):
            table = run / probe_name / "effective_length.csv"
            if not table.is_file():
                problems.append(f"missing {table}")
            elif len(read_csv(table)) < 3:
                problems.append(f"{table}: {len(read_csv(table))} probed checkpoints, need >= 3")
    for name in (
        "REPORT.md",
        "position_freq/summary.json",
        "compare/conclusion.json",
        "compare/checkpoints.csv",
    ):
        if not (out / name).is_file():
            problems.append(f"missing {out / name}")
    json.loads((out / "compare" / "conclusion.json").read_text())
    if len(list((out / "figures").glob("*.png"))) < 4:
        problems.append(f"fewer than 4 figures in {out / 'figures'}")
    if problems:
        raise SystemExit("demo: outputs incomplete:\n  " + "\n  ".join(problems))


def build_parser() -> ArgumentParser:
    """`posfreq demo`: full or quick mode, and where everything goes."""
    parser = command_parser(
        "posfreq demo",
        "The CPU miniature of the whole study, over three seeds: demo corpora and tokenizer, length histogram and "
        "f(i), token shards, warm-up and continued training at two lengths, the NIAH probe of every milestone, "
        "the comparison with computed verdicts, and OUT/REPORT.md listing every command it ran. Finished training "
        "and probing are reused on a rerun.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Every stage at toy scale, about a minute: checks that each stage runs and writes its "
        "outputs (its verdicts mean nothing).",
    )
    parser.add_argument(
        "--experiment",
        type=Literal["demo", "packing"],
        default="demo",
        help="demo: the paper's probing experiment at L = 256 and 512; packing: at L = 512, concat vs "
        "best_fit vs length upsampling, same budget and seeds (scripts/packing_experiment.py).",
    )
    parser.add_argument(
        "--out",
        type=Optional[Path],
        default=None,
        help="Output directory; null: runs/<experiment>, or runs/<experiment>-quick with --quick "
        "(under the current directory). Only a full demo into the default directory replaces the "
        "README's figures in docs/figures.",
    )
    parser.add_argument(
        "--lanes",
        type=Literal[1, 2],
        default=2,
        help="Trainings and probes run side by side (demo experiment).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="Torch threads per lane (OMP_NUM_THREADS of every command; demo experiment). "
        "`--lanes 1 --threads 2` repeats the demo under another thread setting.",
    )
    parser.add_argument(
        "--reference",
        type=Optional[Path],
        default=None,
        help="Another finished demo's output directory (for example runs/demo): REPORT.md and "
        "agreement.json then say whether this run's effective lengths lie inside its intervals and "
        "whether the verdicts are the same.",
    )
    return parser


DEMO_ENTRIES = {
    "REPORT.md",
    "agreement.json",
    "compare",
    "corpus",
    "data",
    "figures",
    "logs",
    "position_freq",
}


def _earlier_demo(out: Path) -> bool:
    """Whether an older posfreq's demo or packing experiment wrote `out` (before output owners were recorded)."""
    return all(
        name in DEMO_ENTRIES or re.fullmatch(r"strict-\dof4|.+-s\d+", name)
        for name in entry_names(out)
    )


def main(argv: list[str] | None = None) -> int:
    """Run every stage, write OUT/REPORT.md, and (full mode) publish the figures to docs/figures."""
    args = parse(build_parser(), argv)
    settings = QUICK if args.quick else FULL
    out = (
        args.out or Path("runs") / (args.experiment + ("-quick" if args.quick else ""))
    ).resolve()
    try:
        claim_output_dir(out, "demo", written_before=_earlier_demo)
    except OutputDirError as err:
        raise SystemExit(f"error: {err}") from None
    if args.experiment == "packing":
        from posfreq.scripts.packing_experiment import run_experiment

        start = time.perf_counter()
        report = run_experiment(out, args.quick)
        print(
            f"\npacking experiment finished in {time.perf_counter() - start:.0f} s; report: {report}"
        )
        return 0
    if args.threads < 1:
        raise SystemExit(f"demo: --threads {args.threads}: give at least one torch thread per lane")
    if args.reference:
        checkpoints_of(
            args.reference / "compare"
        )  # a wrong --reference stops now, before any training
    p = Pipeline(out, args.lanes, args.threads)
    start = time.perf_counter()

    corpus = prepare_inputs(p, settings)
    # The lanes: every seed's warm-up is queued first, then each seed's continued runs, longest first; a
    # continued run waits for its own warm-up, which is queued before it, so none can starve.
    with ThreadPoolExecutor(max_workers=args.lanes) as pool:
        warm = warm_ups(p, settings, pool)
        jobs = {
            f"L{n}-s{s}": pool.submit(
                train_and_probe, p, settings, corpus, out / "data" / "main", warm[s], s, n
            )
            for s in settings.seeds
            for n in sorted(settings.train_lens, reverse=True)
        }
        runs = {
            name: job.result()
            for name, job in sorted(jobs.items(), key=lambda kv: (len(kv[0]), kv[0]))
        }
    p.run(
        "compare runs: Fig. 2a / 2b, verdicts",
        "analysis/compare.py",
        *[run / "probe" for run in runs.values()],
        "--out",
        out / "compare",
    )
    conclusion = json.loads((out / "compare" / "conclusion.json").read_text())
    first = settings.seeds[0]
    table = p.parallel(
        {
            n: functools.partial(table1, p, settings, corpus, runs[f"L{n}-s{first}"], n)
            for n in settings.train_lens
        }
    )
    strict_dir, strict = strict_comparison(p, settings, runs)
    collect_figures(out, runs, first, {"strict": strict_dir / "figures"})
    references = []
    if args.reference:
        comparisons = {"paper": Path("compare"), "strict": strict_dir.relative_to(out)}
        missing = [
            path
            for path in comparisons.values()
            if not (args.reference / path / "checkpoints.csv").is_file()
        ]
        if missing:
            print(
                f"demo: the reference {args.reference} has no {', '.join(map(str, missing))} (an older demo): "
                "those comparisons are left out"
            )
        references = [
            agreement(out, args.reference.resolve(), criterion, path)
            for criterion, path in comparisons.items()
            if path not in missing
        ]
        (out / "agreement.json").write_text(json.dumps(references, indent=1) + "\n")
        print("\n".join(line for reference in references for line in agreement_lines(reference)))
    report = write_report(out, settings, args.quick, p, runs, table, conclusion, strict, references)
    if args.quick:
        validate(out, runs, settings)
    elif args.out is None:
        publish_figures(out)
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s; report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
