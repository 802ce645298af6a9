"""The experiment the paper left open, in miniature: control f(i) from the training side and measure the effect.

    python scripts/demo.py --experiment packing            # 5 seeds; times: docs/performance.md
    python scripts/demo.py --experiment packing --quick    # every stage at toy scale

At one training length (L = 512, where the demo's effective length still grows with training), with
the demo's corpus, warm-up, model and token budget, over 5 seeds, three data variants are trained from the
same warm-up checkpoint of each seed:

- `concat`: the token stream cut into rows of L (the default; documents split again at row ends);
- `best_fit`: whole pieces of at most L tokens packed by best-fit decreasing, the rest of a row padding;
- `concat+upsample`: concat over an epoch in which documents of >= L/2 tokens appear twice.

Every milestone is probed (rope), and analysis/compare.py tests, paired by seed, whether a variant reaches
a larger effective length than concat at equal tokens, and whether the variants' curves coincide against
the position frequency they trained (the paper's claim that f, not the token count, decides the effective
length). OUT/REPORT.md gives the measured effect whichever way it goes, with every command.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.analysis.niah import store
from posfreq.analysis.table_files import read_csv
from posfreq.analysis.tables.columns import CHECKPOINT_COLUMNS
from posfreq.analysis.verdicts.rules import estimate_text, outcome
from posfreq.scripts.miniature.pipeline import (
    Pipeline,
    last_milestone,
    prepare_inputs,
    probe,
    probed_lengths,
    train,
    validation_flags,
    warm_ups,
)
from posfreq.scripts.miniature.report import (
    CENSORED_F_NOTE,
    censored_f,
    markdown,
    prediction_line,
)
from posfreq.scripts.miniature.settings import FULL, QUICK, DemoSettings
from posfreq.train.atomic import write_text_atomic
from posfreq.train.checkpoint.layout import load_trained_lengths, read_trainer_state
from posfreq.train.command_line import code_version

TRAIN_LEN = 512
# variant -> the trainer flags that make it (on top of the demo config)
VARIANTS: dict[str, tuple[str, ...]] = {
    "concat": (),
    "best_fit": ("--data.packing", "best_fit"),
    "concat+upsample": ("--data.length-upsample", json.dumps({f"{TRAIN_LEN // 2}-": 2.0})),
}


PACKING_SEEDS = 5
"""The full experiment's training seeds by default: the causal test reads a t-interval over seeds, and 3 leave it
2 degrees of freedom (t = 4.30 against 2.78 at 5)."""


def experiment_settings(quick: bool) -> DemoSettings:
    """The demo's settings at one training length, rope only, over PACKING_SEEDS seeds (quick: the demo's one)."""
    base = QUICK if quick else replace(FULL, seeds=tuple(range(PACKING_SEEDS)))
    return replace(base, train_lens=(TRAIN_LEN,), string_seeds=(), table1_schemes=())


def train_and_probe_variant(
    p: Pipeline, settings: DemoSettings, corpus: Path, warm, seed: int, variant: str
) -> Path:
    """Continue seed `seed`'s warm-up at L with one data variant, then probe every milestone with rope."""
    run = p.out / f"{variant}-s{seed}"
    train(
        p,
        settings,
        f"train {variant} seed={seed}",
        p.out / "data" / "main",
        run,
        TRAIN_LEN,
        settings.total_tokens,
        seed,
        "--model.init-from",
        warm.result(),
        *VARIANTS[variant],
        *validation_flags(p, settings),
    )
    probe(
        p,
        settings,
        corpus,
        f"probe {variant} seed={seed}",
        probed_lengths(settings, TRAIN_LEN),
        settings.tests_per_length,
        0,
        run / "probe",
        "--run",
        run,
        "--positions",
        "rope",
    )
    return run


def trained_frequency(runs: dict[str, Path]) -> list[dict]:
    """Per run: f(L/2) and f(3L/4) of its last milestone's trained-length histogram (warm-up included; its
    segments are shorter than L/2, so they add nothing here), and the share of this run's row tokens that were
    padding (the warm-up, concat at L = 128, has none: its tokens are all trained)."""
    rows = []
    for name, run in runs.items():
        last = last_milestone(run)
        hist = load_trained_lengths(last)
        f = position_frequency(hist, TRAIN_LEN)
        trainer = read_trainer_state(last)
        trained = int((np.arange(len(hist)) * hist).sum())
        rows.append(
            {
                "run": name,
                "variant": name.rsplit("-s", 1)[0],
                "f_half_L": int(f[TRAIN_LEN // 2]),
                "f_three_quarter_L": int(f[3 * TRAIN_LEN // 4]),
                "padding_share": 1
                - (trained - (int(trainer["tokens_trained"]) - int(trainer["run_tokens"])))
                / int(trainer["run_tokens"]),
            }
        )
    return rows


def verdict_lines(conclusion: dict, quick: bool) -> list[str]:
    """The measured effect of each variant against concat, in words with its numbers."""
    lines = (
        [
            "Quick mode trains for seconds: the numbers below check that every stage runs; they mean nothing."
        ]
        if quick
        else []
    )
    for tests in conclusion["variants"]:
        variant, tokens, against_f = tests["variant"], tests["equal_tokens"], tests["against_f"]
        if outcome(tokens) == "not testable":
            lines.append(f"- {variant}: not testable at equal tokens ({tokens.get('reason')}).")
            continue
        word = {
            "holds": "larger",
            "does not hold": "smaller",
            "not shown": "not shown to differ (the interval holds 0)",
        }[outcome(tokens)]
        lines.append(
            f"- **{variant} vs concat, at equal tokens**: effective length {word}; mean paired difference over "
            f"the milestones {estimate_text(tokens)}, {tokens['interval_method']} (per seed "
            f"{', '.join(f'{d:+.1f}' for d in tokens['mean_difference_per_seed'])}; at the last milestone "
            f"{tokens['last_milestone_differences']}). Rule: {tokens['rule']}."
        )
        if outcome(against_f) == "not testable":
            lines.append(
                f"- {variant} vs concat, against f: not testable ({against_f.get('reason', 'no points')})."
            )
        else:
            word = {
                "holds": "coincide",
                "does not hold": "do not coincide",
                "inconclusive": "are not shown to coincide or differ (inconclusive)",
            }[outcome(against_f)]
            lines.append(
                f"- **{variant} vs concat, against f**: the curves {word}: D at equal effective length "
                f"{estimate_text(against_f)}, {against_f['interval_method']}. Rule: {against_f['rule']}."
            )
    return lines


def write_report(
    out: Path,
    settings: DemoSettings,
    quick: bool,
    p: Pipeline,
    runs: dict[str, Path],
    conclusion: dict,
    frequency: list[dict],
) -> Path:
    """OUT/REPORT.md: the design, the measured effect, the trained f per variant, tables, figures, commands."""
    by_variant: dict[str, list[dict]] = {}
    for row in frequency:
        by_variant.setdefault(row["variant"], []).append(row)
    f_rows = [
        {
            "variant": v,
            "runs": len(rs),
            "f(L/2)": float(np.mean([r["f_half_L"] for r in rs])),
            "f(3L/4)": float(np.mean([r["f_three_quarter_L"] for r in rs])),
            "padding share": float(np.mean([r["padding_share"] for r in rs])),
        }
        for v, rs in by_variant.items()
    ]
    lines = [
        f"# posfreq packing experiment{' (quick mode: toy scale, not a result)' if quick else ''}",
        "",
        f"Code version `{code_version()}`; L = {TRAIN_LEN}; settings: `{json.dumps(asdict(settings))}`; variants: "
        f"`{json.dumps(VARIANTS)}`.",
        "",
        "Same corpus, warm-up, model, token budget and seeds for every variant; only the rows differ.",
        "",
        "## Measured effect (analysis/compare.py; numbers in compare/conclusion.json)",
        "",
        *verdict_lines(conclusion, quick),
        "",
        "## Predicting effective length from f before probing (compare's prediction verdict)",
        "",
        prediction_line(conclusion["prediction"]),
        "",
        "## Trained position frequency at the last milestone (mean over seeds)",
        "",
        markdown(f_rows, ["variant", "runs", "f(L/2)", "f(3L/4)", "padding share"]),
        "",
        "## Effective length per checkpoint and seed",
        "",
        CENSORED_F_NOTE,
        "",
    ]
    for name, run in runs.items():
        rows = [censored_f(r) for r in read_csv(run / "probe" / store.EFFECTIVE_LENGTH_FILE)]
        lines += [
            f"### {name}",
            "",
            markdown(rows, [c for c in CHECKPOINT_COLUMNS if not c.startswith("tf_")]),
            "",
        ]
    lines += ["## Figures", ""]
    lines += [
        f"![{png.stem}](compare/figures/{png.name})"
        for png in sorted((out / "compare" / "figures").glob("*.png"))
    ]
    lines += ["", "## Commands", ""]
    lines += [f"- {stage} ({seconds:.0f} s): `{cmd}`" for stage, cmd, seconds in p.commands]
    path = out / "REPORT.md"
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def run_experiment(out: Path, quick: bool, seeds: int | None = None) -> Path:
    """Every stage of the packing experiment (training seeds 0..seeds-1; None: PACKING_SEEDS, quick: the demo's
    one); returns OUT/REPORT.md."""
    settings = experiment_settings(quick)
    if seeds is not None:
        settings = replace(settings, seeds=tuple(range(seeds)))
    p = Pipeline(out)
    corpus = prepare_inputs(p, settings)
    with ThreadPoolExecutor(max_workers=2) as pool:
        warm = warm_ups(p, settings, pool)
        jobs = {
            f"{v}-s{s}": pool.submit(train_and_probe_variant, p, settings, corpus, warm[s], s, v)
            for s in settings.seeds
            for v in VARIANTS
        }
        runs = {name: job.result() for name, job in jobs.items()}
    p.run(
        "compare variants",
        "analysis/compare.py",
        *[run / "probe" for run in runs.values()],
        "--out",
        out / "compare",
    )
    conclusion = json.loads((out / "compare" / "conclusion.json").read_text())
    return write_report(out, settings, quick, p, runs, conclusion, trained_frequency(runs))
