"""rope vs STRING on a real model: NIAH pass rate by length and RULER's synthetic tasks at its training length.

    python scripts/real_model_table.py --model hf:models/smollm2-135m-instruct \
        --niah-lengths 2048,4096,8192 --niah-tests 4 --ruler-samples 2 [--docs docs/real_model.md]

For each scheme it runs `posfreq probe` (4-needle NIAH; resumable: probed lengths are kept) and
`posfreq ruler` (the eleven synthetic tasks at the training length; each task it finished with the
same model, settings and code is reused), into --out/niah-<scheme> and --out/ruler-<scheme>, then writes the two
tables to --out/table.md and, with --docs, between the markers of that page.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: import the installed posfreq package
    sys.path.pop(0)

from posfreq.scripts.commands import probe, ruler
from posfreq.train.atomic import write_text_atomic
from posfreq.train.command_line import command_parser, parse
from posfreq.train.outdir import OutputDirError, claim_output_dir

COMMAND = "real-model-table"
SCHEMES = ("rope", "string")
BEGIN, END = "<!-- real-model-table:begin -->", "<!-- real-model-table:end -->"


def build_parser():
    """The command line: the model, how many tests and samples, where the outputs go."""
    parser = command_parser("python scripts/real_model_table.py", __doc__.split("\n")[0])
    parser.add_argument("--model", type=str, required=True, help="hf:DIR, a transformers model")
    parser.add_argument("--niah-lengths", type=str, default="2048,4096,8192", help="NIAH lengths")
    parser.add_argument("--niah-tests", type=int, default=4, help="NIAH tests per length")
    parser.add_argument("--ruler-samples", type=int, default=2, help="RULER samples per task")
    parser.add_argument("--chat-template", type=bool, default=True, help="frame prompts as a chat")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: one per core)")
    parser.add_argument("--out", type=str, default="runs/real_model", help="output directory")
    parser.add_argument("--docs", type=str, default=None, help="a page with the table markers")
    return parser


def run_niah(args, scheme: str, out: Path) -> list[dict]:
    """The probe's summary rows (one per length) for `scheme`."""
    argv = ["--model", args.model, "--lengths", args.niah_lengths, "--positions", scheme]
    argv += ["--tests-per-length", str(args.niah_tests), "--out", str(out), "--no-figures"]
    argv += ["--chat-template", str(args.chat_template).lower(), "--threads", str(args.threads)]
    if probe.main(argv) != 0:
        raise SystemExit(f"error: posfreq probe {' '.join(argv)} failed")
    return list(csv.DictReader(open(out / "summary.csv")))


def run_ruler(args, scheme: str, out: Path) -> list[dict]:
    """`posfreq ruler`'s score rows for `scheme` (it reuses every task it finished under the same key)."""
    argv = ["--model", args.model, "--positions", scheme, "--samples", str(args.ruler_samples)]
    argv += ["--chat-template", str(args.chat_template).lower(), "--out", str(out)]
    argv += ["--threads", str(args.threads)]
    if ruler.main(argv) != 0:
        raise SystemExit(f"error: posfreq ruler {' '.join(argv)} failed")
    return list(csv.DictReader(open(out / "scores.csv")))


def niah_table(niah: dict[str, list[dict]]) -> str:
    """Rows: schemes; columns: lengths; cells: tests passed of tests run, and needle recall."""
    lengths = [row["length"] for row in niah[SCHEMES[0]]]
    lines = ["| positions | " + " | ".join(f"n = {n}" for n in lengths) + " |"]
    lines.append("| --- |" + " --- |" * len(lengths))
    for scheme in SCHEMES:
        cells = [
            f"{row['passed']}/{row['n_tests']} ({100 * float(row['needle_recall']):.0f}% of needles)"
            for row in niah[scheme]
        ]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ruler_table(scores: dict[str, list[dict]]) -> str:
    """Rows: tasks and their mean; columns: schemes; cells: RULER score in percent (samples)."""
    rows = {scheme: {row["task"]: row for row in scores[scheme]} for scheme in SCHEMES}
    first = scores[SCHEMES[0]][0]
    lines = [f"| task (n = {first['length']}) | " + " | ".join(SCHEMES) + " |"]
    lines.append("| --- |" + " --- |" * len(SCHEMES))
    for task in rows[SCHEMES[0]]:
        cells = [
            f"{100 * float(rows[s][task]['score']):.1f} ({rows[s][task]['samples']})"
            for s in SCHEMES
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def publish(page: Path, block: str) -> None:
    """Replace what lies between the markers on `page` with `block`."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(
            f"error: {page} has no {BEGIN} ... {END} markers. Fix: add them where the table goes"
        )
    head, rest = text.split(BEGIN, 1)
    page.write_text(f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}")


def main(argv: Sequence[str] | None = None) -> int:
    """Probe and run RULER under each scheme, then write the tables."""
    args = parse(build_parser(), argv)
    try:
        out = claim_output_dir(args.out, COMMAND)
    except OutputDirError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    niah = {scheme: run_niah(args, scheme, out / f"niah-{scheme}") for scheme in SCHEMES}
    scores = {scheme: run_ruler(args, scheme, out / f"ruler-{scheme}") for scheme in SCHEMES}
    block = (
        f"NIAH (4 needles; tests passed, needle recall), `{args.niah_tests}` tests per length:\n\n"
        f"{niah_table(niah)}\n\nRULER's synthetic tasks (score in percent, samples in brackets):\n\n"
        f"{ruler_table(scores)}\n"
    )
    write_text_atomic(out / "table.md", block)
    if args.docs:
        publish(Path(args.docs), block)
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
