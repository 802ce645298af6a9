"""The demo's REPORT.md, its figures and the quick mode's acceptance check."""

from __future__ import annotations

import json
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from posfreq.analysis.niah import store
from posfreq.analysis.table_files import markdown_table, read_csv
from posfreq.analysis.tables.columns import CHECKPOINT_COLUMNS
from posfreq.analysis.tables.paper_tables import TABLE1_COLUMNS, p_text
from posfreq.analysis.tables.pass_curve import STATUS_ALL_PASSED
from posfreq.analysis.verdicts.rules import estimate_text, outcome
from posfreq.scripts.miniature.agreement import agreement_lines
from posfreq.scripts.miniature.pipeline import REPO, DemoError, Pipeline
from posfreq.scripts.miniature.settings import DemoSettings
from posfreq.train.atomic import write_text_atomic
from posfreq.train.command_line import code_version
from posfreq.train.journal import record_written

TABLE1_REPORT_COLUMNS = (
    "scheme",
    "tests",
    *(
        c
        for c in TABLE1_COLUMNS
        if c not in ("scheme", "length", "tests", "tests_left_out", "baseline")
    ),
    "needle_recall",
)
"""The Table 1 analogue's columns in REPORT.md (analysis/tables/paper_tables.py's, and the needle recall)."""


CENSORED_F_NOTE = (
    "f_effective_length is f at the effective length by Eq. 2, the value C2 reads. A row whose every probed "
    "length passed (all_passed) has an effective length that is only a lower bound, and Eq. 2 makes f(L) = 0 "
    "(no segment is longer than L): its f is shown as `censored`, and C2 leaves such rows out."
)
"""What a REPORT.md table of checkpoints says of its f column (`censored_f`)."""


def censored_f(row: dict) -> dict:
    """A checkpoint row as REPORT.md shows it: f at an all-passed row's effective length (a lower bound, where Eq. 2
    gives f(L) = 0, read as 'never trained') shown as censored."""
    if row.get("effective_length_status") == STATUS_ALL_PASSED:
        return {**row, "f_effective_length": "censored"}
    return row


def markdown(rows: list[dict], columns: list[str]) -> str:
    """A REPORT.md table: floats to 2 decimals, an empty cell as a dash."""
    return markdown_table(rows, columns, _cell).rstrip("\n")


def _cell(value) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value)


HOLDS = {
    "holds": "**holds**",
    "does not hold": "**does not hold**",
    "inconclusive": "**inconclusive**",
    "not shown": "**not shown**",
    "not testable": "**not testable**",
}
"""How REPORT.md words a verdict's outcome (`rules.outcome`)."""


def sentence(text: str) -> str:
    """`text` with its first letter capitalised, to open a sentence."""
    return text[:1].upper() + text[1:]


def judged(c: dict) -> str:
    """A tested verdict's numbers and rule: 'Estimate +256 [+120, +392] tokens (t-interval over 3 seeds). Rule: ...'."""
    return f" Estimate {estimate_text(c)} ({c['interval_method']}). Rule: {c['rule']}."


def verdicts(conclusion: dict, quick: bool, with_loss: bool = True) -> list[str]:
    """REPORT.md's conclusion: each computed verdict with its numbers, its interval's units and n, and its rule;
    with_loss=False leaves out the loss-by-distance and needle-recall verdicts (no pass criterion changes them: a
    second criterion's list omits them)."""
    if quick:
        return [
            "Quick mode trains for seconds: it checks that every stage runs and writes its outputs. "
            "Its verdicts below are computed like the full demo's but mean nothing."
        ]
    lines = []
    for name in ("shortfall", "longer_reaches_further", "curves_coincide"):
        c = conclusion[name]
        holds = HOLDS[outcome(c)]
        detail = ""
        if "last_checkpoints" in c:
            detail = (
                " Last checkpoints: "
                + "; ".join(
                    f"L = {x['train_len']} seed {x['seed']}: {x['effective_length']} ({x['status']}, interval "
                    f"[{x.get('effective_length_lo')}, {x['effective_length_hi']}])"
                    for x in c["last_checkpoints"]
                )
                + f". Rule ({c['n']} runs): {c['rule']}."
            )
        if "interval_95" in c:
            detail = judged(c)
        if c.get("censored") and any(c["censored"].values()):
            detail += (
                f" Censored runs (every probed length passed, so the value is a lower bound capped by L) per "
                f"length: {c['censored']}."
            )
        if "reason" in c:
            detail += f" {sentence(c['reason'])}."
            if "n_points" in c and "interval_95" not in c:
                detail += f" Points with a defined, uncensored effective length per training length: {c['n_points']}."
        test = f" Test: {c['test']}." if "test" in c else ""
        lines.append(f"- {c['claim']}: {holds}.{detail}{test}")
    if with_loss and "loss_curves_coincide" in conclusion:
        lines.append(loss_line(conclusion["loss_curves_coincide"]))
    if with_loss and "recall_curves_coincide" in conclusion:
        lines.append(recall_line(conclusion["recall_curves_coincide"]))
    if "prediction" in conclusion:
        lines.append(prediction_line(conclusion["prediction"]))
    return lines


def loss_line(c: dict) -> str:
    """C2 on the validation loss by distance (analysis/verdicts/loss_frequency.py): D at equal loss, and the
    difference at equal distance where the shorter length trained the distance rarely."""
    if "interval_95" not in c:
        return f"- {c['claim']}: {HOLDS[outcome(c)]} ({c['reason']})."
    line = (
        f"- {c['claim']}: {HOLDS[outcome(c)]} (distance buckets per length: {c['n_points']}).{judged(c)} "
        f"Test: {c['test']}."
    )
    e = c["at_equal_distance"]
    if "interval_95" not in e:
        return line + f" At equal distance: {HOLDS[outcome(e)]} ({e['reason']})."
    return line + (
        f" {sentence(e['claim'])}: {HOLDS[outcome(e)]}. Distances {e['distances'][0]}-"
        f"{e['distances'][1]} ({e['buckets']} buckets, f ratio {e['f_ratio'][0]:.2f}-{e['f_ratio'][1]:.2f}): "
        f"loss difference{judged(e)}"
    )


def recall_line(c: dict) -> str:
    """C2 on needle recall by distance (analysis/verdicts/recall_frequency.py): D at equal recall, and the
    difference at equal tokens and distance where the shorter length trained the distance rarely."""
    detail = judged(c) if "interval_95" in c else f" {sentence(c['reason'])}."
    line = f"- {c['claim']}: {HOLDS[outcome(c)]}.{detail}"
    if "n_points" in c:
        line += f" Distance bins per length: {c['n_points']}. Test: {c['test']}."
    e = c.get("at_equal_tokens")
    if e is None:
        return line
    if "interval_95" not in e:
        return line + f" {sentence(e['claim'])}: {HOLDS[outcome(e)]} ({e['reason']})."
    return line + (
        f" {sentence(e['claim'])}: {HOLDS[outcome(e)]} ({e['bins_compared']} milestone and distance pairs): "
        f"recall difference{judged(e)}"
    )


def prediction_line(c: dict) -> str:
    """The prediction verdict (analysis/verdicts/prediction.py): the held-out errors of f's threshold rule and of the
    baselines, per way of holding out, and the rule's gain over the best baseline."""
    holds = HOLDS[outcome(c)]
    if not any(k.startswith("by_") for k in c):
        return f"- f(n) predicts held-out runs' effective length: {holds} ({c['reason']})."
    parts = []
    for key, name in (
        ("by_seed", "each seed held out"),
        ("by_train_len", "each training length held out"),
        ("by_variant", "each data variant held out"),
    ):
        if key not in c:
            continue
        v = c[key]
        if "mean_abs_error" not in v:
            parts.append(f"{name}: {v.get('reason', 'not run')}")
            continue
        e = v["mean_abs_error"]
        gain = (
            f"gain over {v['best_baseline']} {estimate_text(v)} ({v['interval_method']}): {outcome(v)}"
            if "interval_95" in v
            else f"gain not testable ({v['reason']})"
        )
        parts.append(
            f"{name} ({v['checkpoints']} checkpoints): mean absolute error {e['f_rule']:.0f} tokens by f, "
            f"{e['tokens_alone']:.0f} by tokens alone capped at L, {e['constant_L']:.0f} by the constant L, "
            f"{e['previous_checkpoint']:.0f} by the previous checkpoint; {gain}"
        )
    rule = f" Rule: {c['rule']}." if "rule" in c else ""
    return f"- {c['claim']}: {holds}. " + "; ".join(parts) + f".{rule} Test: {c['test']}."


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


@dataclass(frozen=True)
class DemoOutcome:
    """What the demo's stages produced, for its report: each run's folder, the Table 1 analogue per training length,
    the conclusions under the paper's and the strict criterion, and the agreement with a reference demo."""

    runs: dict[str, Path]
    table: dict[int, list[dict]]
    conclusion: dict
    strict: dict
    strict_dir: Path
    """Where the strict criterion's comparison lives (OUT/strict-kof4)."""
    references: list[dict] = field(default_factory=list)


def write_report(
    out: Path,
    settings: DemoSettings,
    quick: bool,
    pipeline: Pipeline,
    outcome: DemoOutcome,
    experiment: str = "demo",
) -> Path:
    """REPORT.md: what ran, what came out (computed verdicts with their numbers), every command."""
    lines = [
        f"# posfreq {experiment} report{' (quick mode: toy scale, not a result)' if quick else ''}",
        "",
        f"Code version `{code_version()}`; settings: `{json.dumps(asdict(settings))}`; {pipeline.lanes} lane(s) of "
        f"{pipeline.threads} torch thread(s) (OMP_NUM_THREADS={pipeline.threads}); machine: {machine_description()}.",
        "",
        f"A test of length n is a prompt of n - {settings.answer_budget} tokens and at most "
        f"{settings.answer_budget} generated tokens, so no token is generated at a position >= n. "
        "Token counts include the warm-up (`tokens_trained`).",
        "",
        *_conclusion_lines(settings, quick, outcome),
        *_checkpoint_lines(outcome.runs),
        *_table1_lines(settings, outcome.table),
        "## Figures",
        "",
        *[
            f"![{figure.stem}](figures/{figure.name})"
            for figure in sorted((out / "figures").glob("*.png"))
        ],
        "",
        "## Commands",
        "",
        *[f"- {stage} ({seconds:.0f} s): `{cmd}`" for stage, cmd, seconds in pipeline.commands],
    ]
    path = out / "REPORT.md"
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def _conclusion_lines(settings: DemoSettings, quick: bool, outcome: DemoOutcome) -> list[str]:
    """The verdicts under the paper's criterion and the strict one, the agreement with a reference, and when each
    run learnt retrieval."""
    return [
        "## Conclusion (computed by analysis/compare.py; numbers in compare/conclusion.json)",
        "",
        "A test passes when its answer holds at least 2 of its 4 needles (the paper's criterion).",
        "",
        *verdicts(outcome.conclusion, quick),
        "",
        f"### The same under a stricter criterion: at least {settings.strict_min_retrieved} of 4 needles",
        "",
        f"Re-derived from the same per-test records, no decoding (strict-{settings.strict_min_retrieved}of4/compare/"
        "conclusion.json). The k-th nearest needle sets how far a test must reach, so a stricter k measures "
        "retrieval farther from the question.",
        "",
        *verdicts(outcome.strict, quick, with_loss=False),
        "",
        *[line for reference in outcome.references for line in agreement_lines(reference)],
        "## When each run learnt retrieval",
        "",
        markdown(
            outcome.conclusion["emergence"],
            ["train_len", "seed", "checkpoints", "first_retrieval_tokens", "share_of_budget"],
        ),
        "",
    ]


def _checkpoint_lines(runs: dict[str, Path]) -> list[str]:
    """Each run's effective length per checkpoint, probe folder by probe folder."""
    lines = [
        "## Effective length per checkpoint (95% bootstrap interval over tests)",
        "",
        CENSORED_F_NOTE,
        "",
    ]
    for name, run in runs.items():
        for probe_dir in sorted(d for d in run.glob("probe*") if d.is_dir()):
            rows = [censored_f(r) for r in read_csv(probe_dir / store.EFFECTIVE_LENGTH_FILE)]
            shown = [*CHECKPOINT_COLUMNS] + [c for c in rows[0] if c.startswith("pass_rate_")]
            lines += [f"### {name}, {probe_dir.name}", "", markdown(rows, shown), ""]
    return lines


def _table1_lines(settings: DemoSettings, table: dict[int, list[dict]]) -> list[str]:
    """The Table 1 analogue of each training length, with its paired tests against rope."""
    lines = [
        f"## Table 1 analogue: pass rate at the training length, last checkpoint (seed {settings.seeds[0]})",
        "",
        "Each scheme's pass rate with its 95% Wilson interval; its paired difference from rope over the same tests "
        "with a 95% paired bootstrap interval; the tests only it passed and only rope passed, with the exact McNemar "
        "p and its Holm adjustment over the schemes of the length (a difference is shown at 5% when its Holm p is "
        "at most 0.05).",
        "",
    ]
    for train_len, rows in table.items():
        lines += [
            f"### L = {train_len}",
            "",
            markdown(
                [
                    {**r, **{k: p_text(r[k]) for k in ("mcnemar_p", "holm_p") if r[k] != ""}}
                    for r in rows
                ],
                [*TABLE1_REPORT_COLUMNS],
            ),
            "",
        ]
    return lines


def publish_figures(out: Path, repo: Path = REPO) -> list[Path]:
    """Copy this run's figures into the checkout's docs/figures for the README and docs/ (an explicit step:
    `posfreq demo --publish-figures`), each replacing only the figure of its own name: nothing else there is
    deleted or changed (other pages' figures stay). An installed posfreq has no docs/ to publish to. Returns the
    files written."""
    if not (repo / "docs").is_dir():
        print(f"not a checkout (no {repo / 'docs'}): the figures stay in {out / 'figures'}")
        return []
    target = repo / "docs" / "figures"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for png in sorted((out / "figures").glob("*.png")):
        shutil.copy2(png, target / png.name)
        written.append(target / png.name)
    return written


def collect_figures(
    out: Path, runs: dict[str, Path], first_seed: int, extra: dict[str, Path]
) -> None:
    """Gather the figures the report shows into OUT/figures: f(i), the comparison, the first seed's heatmaps, and
    those of each `extra` directory, prefixed with its name (but its loss figures: no pass criterion changes them)."""
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for png in [
        *(out / "position_freq" / "figures").glob("fig*.png"),
        *(out / "compare" / "figures").glob("*.png"),
    ]:
        record_written(figures / png.name)
        shutil.copy2(png, figures / png.name)
    for prefix, directory in extra.items():
        for png in directory.glob("*.png"):
            if png.name.startswith("loss_"):
                continue
            record_written(figures / f"{prefix}_{png.name}")
            shutil.copy2(png, figures / f"{prefix}_{png.name}")
    for name, run in runs.items():
        if name.endswith(f"-s{first_seed}"):
            last = sorted((run / "probe").glob("tokens-*"))[-1]
            for png in (last / "figures").glob("*.png"):
                record_written(figures / f"{name}_{png.name}")
                shutil.copy2(png, figures / f"{name}_{png.name}")


def validate(out: Path, runs: dict[str, Path], settings: DemoSettings) -> None:
    """The quick mode's acceptance check: outputs exist and parse, >= 3 probed checkpoints per run."""
    problems = []
    for name, run in runs.items():
        seed = int(name.rsplit("-s", 1)[1])
        for probe_name in (
            ("probe", "probe-string") if seed in settings.string_seeds else ("probe",)
        ):
            table = run / probe_name / store.EFFECTIVE_LENGTH_FILE
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
        raise DemoError("demo: outputs incomplete:\n  " + "\n  ".join(problems))
