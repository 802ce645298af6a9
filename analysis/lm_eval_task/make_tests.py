"""Write posfreq's 4-needle NIAH tests as a local lm-evaluation-harness task: JSONL data and task YAML per length.

    python analysis/lm_eval_task/make_tests.py --tokenizer hf:EXPORTED --lengths 256,512 --out runs/lmeval/niah
    lm_eval --model hf --model_args pretrained=EXPORTED,dtype=float32 --device cpu \\
        --include_path runs/lmeval/niah --tasks posfreq_niah

The tests are the probe's own (`analysis.niah.needles.NiahBuilder`, as `scripts/commands/probe.py` builds them):
the same seed, haystack, answer budget B and BOS policy give the same needles, depths and
prompts. lm-eval receives text, so each prompt is stored as text without BOS (the model's
tokenizer adds BOS or not, as it does for the probe's Hugging Face models with `--bos auto`),
and its task's `max_gen_toks` is B. Every record says whether its text re-encodes to exactly the
probe's ids (`reencodes_exactly`; always true for the `bytes` tokenizer, since the probe
tokenizes the prompt piece by piece). Nothing is downloaded: the haystack is the probe's.

OUT receives `tests_L<n>.jsonl` and `posfreq_niah_<n>.yaml` for every length n (each includes
`posfreq_niah.yaml` beside this file, so keep this checkout) and `posfreq_niah_group.yaml`, the
group `posfreq_niah` over all lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import yaml

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from posfreq.analysis.niah.needles import (
    ANSWER_BUDGET,
    NiahBuilder,
    NiahTest,
    PromptFormat,
    answer_text,
)
from posfreq.analysis.niah.settings import parse_lengths
from posfreq.train.atomic import write_text_atomic
from posfreq.train.command_line import command_parser, parse, summary
from posfreq.train.data.tokenizer import Tokenizer, get_tokenizer

BASE_YAML = Path(__file__).resolve().parent / "posfreq_niah.yaml"
GROUP = "posfreq_niah"


def jsonl_record(
    test: NiahTest, tokenizer: Tokenizer, bos: bool, min_retrieved: int, scoring: str
) -> dict:
    """One JSONL line: the prompt text lm-eval sends, everything scoring needs, and the test's provenance."""
    ids = test.input_ids[int(bos) :].tolist()
    return {
        **test.record(),
        "prompt": test.prompt,
        "answer": answer_text(list(test.needles)),
        "bos": bos,
        "min_retrieved": min_retrieved,
        "scoring": scoring,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "reencodes_exactly": tokenizer.encode(test.prompt) == ids,
    }


def task_config(length: int, data: Path, answer_budget: int, provenance: dict) -> dict:
    """The task of one length: the shared definition, this length's JSONL and an answer budget of B tokens."""
    return {
        "include": str(BASE_YAML),
        "task": f"{GROUP}_{length}",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": answer_budget},
        "metadata": {"version": 1.0, "length": length, **provenance},
    }


def group_config(lengths: Sequence[int]) -> dict:
    """The group over every length: pass rate, needle recall and all-four rate over all tests."""
    return {
        "group": GROUP,
        "task": [f"{GROUP}_{n}" for n in lengths],
        "aggregate_metric_list": [
            {"metric": m, "aggregation": "mean", "weight_by_size": True}
            for m in ("passed", "needle_recall", "all_needles")
        ],
        "metadata": {"version": 1.0},
    }


@dataclass(frozen=True)
class TaskTests:
    """The tests every length's task holds, built and scored as the probe's with the same settings."""

    tests_per_length: int
    seed: int
    haystack: str
    answer_budget: int
    bos: bool
    min_retrieved: int
    scoring: str


def write_task(
    out: Path, tokenizer: Tokenizer, lengths: Sequence[int], tests: TaskTests
) -> dict[int, int]:
    """Write every length's JSONL and task YAML and the group YAML; returns, per length, tests that re-encode exactly."""
    builder = NiahBuilder(tokenizer, tests.haystack, PromptFormat(tests.answer_budget, tests.bos))
    provenance = {
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "seed": tests.seed,
        "haystack": builder.haystack.name,
        "haystack_sha256": builder.haystack.sha256,
        "answer_budget": tests.answer_budget,
        "bos": tests.bos,
        "min_retrieved": tests.min_retrieved,
        "scoring": tests.scoring,
    }
    out.mkdir(parents=True, exist_ok=True)
    exact = {}
    for length in lengths:
        records = [
            jsonl_record(test, tokenizer, tests.bos, tests.min_retrieved, tests.scoring)
            for test in builder.make_tests(length, tests.tests_per_length, tests.seed)
        ]
        data = out / f"tests_L{length:06d}.jsonl"
        write_text_atomic(data, "".join(json.dumps(r) + "\n" for r in records))
        write_text_atomic(
            out / f"{GROUP}_{length}.yaml",
            yaml.safe_dump(
                task_config(length, data, tests.answer_budget, provenance), sort_keys=False
            ),
        )
        exact[length] = sum(r["reencodes_exactly"] for r in records)
    write_text_atomic(
        out / f"{GROUP}_group.yaml", yaml.safe_dump(group_config(lengths), sort_keys=False)
    )
    return exact


def build_parser():
    """The command line: the model's tokenizer, the probe's test settings, and where the task goes."""
    parser = command_parser("python analysis/lm_eval_task/make_tests.py", summary(__doc__))
    parser.add_argument(
        "--tokenizer",
        type=str,
        required=True,
        help="the evaluated model's tokenizer: hf:DIR for an exported model (the files lm-eval "
        "loads), or llama3 / bytes",
    )
    parser.add_argument(
        "--lengths",
        type=str,
        required=True,
        help="test lengths n (prompt + answer budget): START:STOP:STEP (STOP included) or a comma list",
    )
    parser.add_argument(
        "--out", type=str, required=True, help="directory for the JSONL data and task YAML files"
    )
    parser.add_argument(
        "--tests-per-length",
        type=int,
        default=500,
        help="NIAH tests per length (the probe's default)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=ANSWER_BUDGET,
        help="the answer budget B: prompts of n - B tokens, lm-eval's max_gen_toks = B",
    )
    parser.add_argument("--seed", type=int, default=0, help="test seed, as the probe's --seed")
    parser.add_argument(
        "--haystack",
        type=str,
        default="pg",
        help="pg (Paul Graham essays), noise, or a .txt file / directory, as the probe's --haystack",
    )
    parser.add_argument(
        "--bos",
        type=Literal["auto", "always", "never"],
        default="auto",
        help="whether the model sees BOS before the prompt: auto = the tokenizer's own convention, "
        "which lm-eval's hf model follows unless given add_bos_token",
    )
    parser.add_argument(
        "--min-retrieved", type=int, default=2, help="needles (of 4) a passing answer must contain"
    )
    parser.add_argument(
        "--scoring",
        type=Literal["anywhere", "first_line"],
        default="anywhere",
        help="count needles anywhere in the answer (the probe's default) or on its first line only",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Build the tests, write the task, and say how many prompts re-encode to the probe's exact ids."""
    args = parse(build_parser(), argv)
    try:
        lengths = parse_lengths(args.lengths)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}") from None
    if min(args.tests_per_length, args.max_new_tokens) < 1 or not 1 <= args.min_retrieved <= 4:
        raise SystemExit(
            "--tests-per-length and --max-new-tokens must be >= 1, --min-retrieved in 1..4"
        )
    tokenizer = get_tokenizer(args.tokenizer)
    bos = {"always": True, "never": False}.get(args.bos, tokenizer.adds_bos)
    out = Path(args.out)
    try:
        tests = TaskTests(
            args.tests_per_length,
            args.seed,
            args.haystack,
            args.max_new_tokens,
            bos,
            args.min_retrieved,
            args.scoring,
        )
        exact = write_task(out, tokenizer, lengths, tests)
    except (
        ValueError
    ) as err:  # e.g. a length too short for the frame, the needles and the answer budget
        raise SystemExit(f"error: {err}") from None
    for length, count in exact.items():
        note = (
            ""
            if count == args.tests_per_length
            else " (the others differ from the probe's ids: see the README)"
        )
        print(
            f"length {length}: {args.tests_per_length} tests, {count} re-encode to the probe's exact ids{note}"
        )
    print(
        f"task {GROUP} ({', '.join(f'{GROUP}_{n}' for n in exact)}) in {out}/; BOS before prompts: {bos}; "
        f"run: lm_eval --model hf --model_args pretrained=DIR --include_path {out} --tasks {GROUP}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
