"""RULER's eleven synthetic tasks on a Hugging Face model, offline, with rope or STRING (docs/ruler.md).

    posfreq ruler --model hf:DIR [--positions string] [--lengths 4096,8192] [--samples 500] [--out DIR]

The tasks are analysis/ruler_task's (lm-eval's own RULER generators; the essay haystack and the
sentence model from what posfreq ships), run by lm-evaluation-harness on the model loaded by
transformers, with STRING applied through `train.string_hf` when asked. Nothing touches the
network: the hub and datasets libraries are put offline before they load. Writes scores.csv (one
row per task and length, and the mean over tasks), results.json (lm-eval's results and the
settings) and, with --log-samples, each task's prompts and answers.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from argparse import ArgumentTypeError
from pathlib import Path
from typing import Literal, Optional, Sequence

if __package__ in (None, ""):  # run as a file: import the installed posfreq package
    sys.path.pop(0)

from posfreq.analysis.probe_settings import parse_lengths
from posfreq.train.command_line import command_parser, parse
from posfreq.train.devices import resolve_device
from posfreq.train.outdir import OutputDirError, check_output_dir, claim_output_dir
from posfreq.train.tokenizer import hf_dir

COMMAND = "ruler"
TASK_DIR = Path(__file__).resolve().parent / "ruler_task"
TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
"""RULER's synthetic tasks, in its order; lm-eval names them posfreq_ruler_<task>."""
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class RulerError(ValueError):
    """A setting or input the command cannot run with; the message names it and the fix."""


def build_parser():
    """The command line: the model, the position scheme, lengths, tasks, samples and outputs."""
    parser = command_parser("posfreq ruler", __doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=str, required=True, help="hf:DIR, a local transformers model"
    )
    parser.add_argument(
        "--positions", type=Literal["rope", "string"], default="rope", help="rope, or STRING"
    )
    parser.add_argument(
        "--shift", type=Optional[int], default=None, help="STRING's S; default L // 3"
    )
    parser.add_argument(
        "--window", type=Optional[int], default=None, help="STRING's W; default min(128, S // 2)"
    )
    parser.add_argument(
        "--train-len",
        type=Optional[int],
        default=None,
        help="the training length L: STRING's defaults and the default length (config's "
        "max_position_embeddings if unset)",
    )
    parser.add_argument(
        "--lengths",
        type=Optional[str],
        default=None,
        help="prompt lengths, a comma list or START:STOP:STEP (STOP included); default L",
    )
    parser.add_argument(
        "--tasks", type=str, default="all", help=f"comma list of {', '.join(TASKS)}; or all"
    )
    parser.add_argument(
        "--samples", type=int, default=500, help="samples per task and length (RULER: 500)"
    )
    parser.add_argument(
        "--chat-template",
        type=bool,
        default=False,
        help="frame each prompt with the tokenizer's chat template (instruct models)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="prompts generated together")
    parser.add_argument("--device", type=str, default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)"
    )
    parser.add_argument(
        "--dtype",
        type=Literal["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on a CPU",
    )
    parser.add_argument(
        "--out", type=Optional[str], default=None, help="default runs/ruler/<model>-<positions>"
    )
    parser.add_argument(
        "--log-samples", type=bool, default=False, help="also write every prompt and answer"
    )
    return parser


def model_dir(spec: str) -> Path:
    """The directory of `--model hf:DIR` (or a bare DIR), which must hold a config.json."""
    path = hf_dir(spec) or Path(spec)
    if not (path / "config.json").is_file():
        raise RulerError(
            f"--model {spec}: no config.json in {path}. Fix: pass a transformers model directory "
            "(posfreq export-hf writes one from a checkpoint)"
        )
    return path


def chosen_tasks(spec: str) -> list[str]:
    """`--tasks`: all eleven, or a comma list of their names."""
    if spec == "all":
        return list(TASKS)
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise RulerError(f"--tasks {spec}: unknown {unknown}. Fix: choose from {', '.join(TASKS)}")
    return names


def run(args) -> Path:
    """Evaluate, write the outputs, and return the output directory."""
    os.environ.update(
        OFFLINE_ENV
    )  # before transformers, datasets and lm-eval import the hub client
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoConfig, AutoTokenizer

    from posfreq.train.string_hf import load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    tasks = chosen_tasks(args.tasks)
    config = AutoConfig.from_pretrained(path)
    train_len = args.train_len or config.max_position_embeddings
    try:
        lengths = parse_lengths(args.lengths) if args.lengths else [train_len]
    except ArgumentTypeError as err:
        raise RulerError(f"{err}. Fix: e.g. --lengths 4096,8192 or 4096:16384:4096") from None
    out = Path(args.out or f"runs/ruler/{path.resolve().name}-{args.positions}")
    check_output_dir(out, COMMAND)
    device = resolve_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.chat_template and not tokenizer.chat_template:
        raise RulerError(
            f"--chat-template true: {path} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template). Fix: drop the flag"
        )
    model = load_causal_lm(
        path, args.positions, args.shift, args.window, args.train_len, dtype=dtype
    ).to(device)
    string = getattr(model.config, "posfreq_string", None) or {}
    # RULER sizes each prompt to its length; a chat template adds its own tokens, which lm-eval would
    # cut from the prompt's start (the instructions) at max_length: leave it room instead.
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=args.batch_size,
        max_length=2 * max(lengths),
    )
    manager = TaskManager(
        include_path=str(TASK_DIR),
        metadata={"tokenizer": str(path), "max_seq_lengths": lengths, "num_samples": args.samples},
    )
    evaluation = simple_evaluate(
        model=lm,
        tasks=[f"posfreq_ruler_{task}" for task in tasks],
        task_manager=manager,
        apply_chat_template=args.chat_template,
        log_samples=True,
        bootstrap_iters=0,
    )
    settings = {
        "model": str(path.resolve()),
        "positions": args.positions,
        "shift": string.get("shift"),
        "window": string.get("window"),
        "train_len": train_len,
        "lengths": lengths,
        "samples": args.samples,
        "chat_template": args.chat_template,
        "dtype": str(dtype).removeprefix("torch."),
    }
    rows = score_rows(evaluation["samples"], tasks, lengths, settings)
    claim_output_dir(out, COMMAND)
    write_outputs(out, evaluation, rows, settings, args.log_samples)
    print_table(rows, lengths)
    print(f"wrote {out}")
    return out


def score_rows(
    samples: dict[str, list[dict]], tasks: list[str], lengths: list[int], settings: dict
) -> list[dict]:
    """One row per (task, length): the mean RULER score over its samples; then the mean over tasks."""
    rows = []
    for task in tasks:
        logged = samples[f"posfreq_ruler_{task}"]
        for length in lengths:
            scores = [
                entry[str(length)] for entry in logged if entry["doc"]["max_length"] == length
            ]
            if not scores:
                raise RulerError(f"{task} at {length}: lm-eval returned no samples")
            rows.append(
                {
                    "task": task,
                    "length": length,
                    "score": sum(scores) / len(scores),
                    "samples": len(scores),
                }
            )
    for length in lengths:
        at = [row for row in rows if row["length"] == length]
        rows.append(
            {
                "task": "mean",
                "length": length,
                "score": sum(row["score"] for row in at) / len(at),
                "samples": sum(row["samples"] for row in at),
            }
        )
    keep = {key: settings[key] for key in ("positions", "shift", "window")}
    return [{**row, **keep} for row in rows]


def write_outputs(out: Path, evaluation: dict, rows: list[dict], settings: dict, log: bool) -> None:
    """scores.csv, results.json and (if asked) samples_<task>.jsonl."""
    with open(out / "scores.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "settings": settings,
        "results": evaluation["results"],
        "versions": evaluation.get("versions"),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if log:
        for task, entries in evaluation["samples"].items():
            with open(out / f"samples_{task}.jsonl", "w") as handle:
                for entry in entries:
                    handle.write(json.dumps(entry, default=str) + "\n")


def print_table(rows: list[dict], lengths: list[int]) -> None:
    """Scores in percent, a row per task and a column per length (RULER's layout)."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    score = {(row["task"], row["length"]): row["score"] for row in rows}
    print("task".ljust(16) + "".join(f"{n:>9}" for n in lengths))
    for task in tasks:
        print(task.ljust(16) + "".join(f"{100 * score[task, n]:9.1f}" for n in lengths))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn a refusal into one `error:` line (exit 1)."""
    args = parse(build_parser(), argv)
    try:
        run(args)
    except (RulerError, OutputDirError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
