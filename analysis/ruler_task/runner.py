"""Running RULER's eleven synthetic tasks on a Hugging Face model, offline, with any position scheme (`posfreq ruler`).

The tasks are analysis/ruler_task's (lm-eval's own RULER generators; the essay haystack and the
sentence model from what posfreq ships), run by lm-evaluation-harness on the model loaded by
transformers, with its position scheme applied through `train.positions.hf_schemes`. Nothing touches the
network: the hub and datasets libraries are put offline before they load. Writes scores.csv (one
row per task and length, and the mean over tasks), results.json (lm-eval's results and the
settings) and, with --log-samples, each task's prompts and answers. Each (task, length) is one
lm-eval call, saved under parts/ with a key of everything its score depends on: an interrupted
run resumes, and a rerun evaluates only what changed.
"""

from __future__ import annotations

import csv
import json
import os
from argparse import ArgumentTypeError
from pathlib import Path

from posfreq.analysis.keys import ruler_code, ruler_unit_key
from posfreq.analysis.niah.settings import parse_lengths
from posfreq.analysis.ruler_task.evaluate import TASK_DIR, Evaluator, RulerError
from posfreq.analysis.ruler_task.settings import RulerSettings
from posfreq.train.atomic import atomic_open, write_json_atomic
from posfreq.train.data.hf_tokenizer import render_in_sandbox
from posfreq.train.data.tokenizer import hf_dir
from posfreq.train.devices import resolve_device
from posfreq.train.fingerprint import files_sha256
from posfreq.train.model.hf_folder import (
    ModelFolderError,
    check_weight_files,
    read_model_config,
    refuse_custom_code,
    transformers_config,
)
from posfreq.train.outdir import check_output_dir, claim_output_dir

COMMAND = "ruler"


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


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf")


def task_yamls() -> list[str]:
    """The task folder's YAML files, relative to the repository."""
    return sorted(f"analysis/ruler_task/{f.name}" for f in TASK_DIR.glob("*.yaml"))


PARTS_DIR = "parts"
LOG_FILE = "ruler.log"
"""One JSON file per finished (task, length) and content key: a rerun evaluates only what is missing."""


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def model_dir(spec: str) -> tuple[Path, dict]:
    """The directory of `--model hf:DIR` (or a bare DIR) and its config.json, checked (a readable config, weights
    whose headers read, no code of its own) before any task is built."""
    path = hf_dir(spec) or Path(spec)
    if not (path / "config.json").is_file():
        raise RulerError(
            f"--model {spec}: no config.json in {path}. Fix: pass a transformers model directory "
            "(posfreq export-hf writes one from a checkpoint)"
        )
    try:  # lm-eval's RULER tasks load the tokenizer by this path with trust_remote_code
        refuse_custom_code(path, "--model")
        config = read_model_config(path)
        check_weight_files(path)
    except ModelFolderError as err:
        raise RulerError(str(err)) from None
    return path, config


def chosen_tasks(spec: str) -> list[str]:
    """`--tasks`: all eleven, or a comma list of their names."""
    if spec == "all":
        return list(TASKS)
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise RulerError(f"--tasks {spec}: unknown {unknown}. Fix: choose from {', '.join(TASKS)}")
    return names


def sandboxed_tokenizer(path: Path, chat_template: bool):
    """The model's transformers tokenizer, its chat template rendered in posfreq's sandbox (lm-eval renders
    through it: never transformers' own Jinja); RulerError when it does not load, or has no template to use."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RulerError(
            f"--model {path}: its tokenizer does not load ({first}). Fix: save it beside the model "
            "(tokenizer.save_pretrained(DIR) writes tokenizer.json)"
        ) from None
    render_in_sandbox(tokenizer)
    if chat_template and not tokenizer.chat_template:
        raise RulerError(
            f"--chat-template true: {path} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template). Fix: drop the flag"
        )
    return tokenizer


def run(args: RulerSettings) -> Path:
    """Evaluate each (task, length) not already in --out/parts, write the outputs, and return --out."""
    os.environ.update(
        OFFLINE_ENV
    )  # before transformers, datasets and lm-eval import the hub client
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path, config = model_dir(args.model)
    tasks = chosen_tasks(args.tasks)
    train_len = args.train_len or config.get("max_position_embeddings")
    if not train_len:
        raise RulerError(
            f"{path / 'config.json'} has no max_position_embeddings. Fix: pass --train-len"
        )
    options = position_options(args)
    resolved = resolved_options(path, args.positions, train_len, options)
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
    request = {
        "model": model_fingerprint(path),
        "positions": args.positions,
        "position_options": options,
        "engine": "transformers",
        "train_len": train_len,
        "samples": args.samples,
        "chat_template": args.chat_template,
        "batch_size": args.batch_size,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "code": code_fingerprint(),
        "data": data_fingerprint(),
    }
    tokenizer = sandboxed_tokenizer(path, args.chat_template)
    refuse_misfits(tokenizer, tasks, lengths)
    claim_output_dir(out, COMMAND, shared=True)
    (out / PARTS_DIR).mkdir(exist_ok=True)
    log = out / LOG_FILE
    evaluator = Evaluator(path, tokenizer, args, options, device, dtype, max(lengths), log)
    print(f"ruler: lm-eval's and transformers' notices go to {log}", flush=True)
    parts = []
    for task in tasks:
        for length in lengths:
            key = ruler_unit_key(request, task, length)
            file = out / PARTS_DIR / f"{task}-L{length}-{key}.json"
            part = reusable_part(file, key, args.log_samples)
            print(f"ruler: {task} at {length}: {'reused' if part else 'evaluating'}", flush=True)
            if part is None:
                part = {"key": key, **evaluator.evaluate(task, length)}
                write_json_atomic(file, part, default=str)
            parts.append(part)
    settings = {
        "model": str(path.resolve()),
        **{key: request[key] for key in ("positions", "train_len", "samples", "chat_template")},
        "position_options": resolved,
        "lengths": lengths,
        "dtype": request["dtype"],
    }
    rows = score_rows(parts, tasks, lengths, settings)
    write_outputs(out, parts, rows, settings, args.log_samples)
    print_table(rows, lengths)
    print(f"wrote {out}")
    return out


def refuse_misfits(tokenizer, tasks: list[str], lengths: list[int]) -> None:
    """RulerError naming every task that cannot fit a length with this tokenizer (and why), before any is run."""
    from posfreq.analysis.ruler_task.tasks import misfits

    problems = misfits(tokenizer, tasks, lengths)
    if problems:
        raise RulerError(
            f"{len(problems)} task(s) cannot run at the lengths asked for; nothing was evaluated:\n  "
            + "\n  ".join(problems)
        )


def position_options(args: RulerSettings) -> dict:
    """The scheme's options as given: --position-options, with --shift and --window (STRING's) when set."""
    options = dict(args.position_options or {})
    options |= {k: getattr(args, k) for k in ("shift", "window") if getattr(args, k) is not None}
    return options


def resolved_options(path: Path, positions: str, train_len: int, options: dict) -> dict:
    """Every option the scheme will run with (defaults from the training length), from the model's config alone:
    a bad option stops the command before any tokenizer, data or weights load."""
    from posfreq.train.positions.hf_schemes import scheme_options

    try:
        refuse_custom_code(path, "the model folder")
        config = transformers_config(path)
    except ModelFolderError as err:
        raise RulerError(str(err)) from None
    try:
        return scheme_options(config, positions, train_len, **options)
    except ValueError as err:
        raise RulerError(
            f"--positions {positions} {json.dumps(options)}: {err} (--train-len {train_len})"
        ) from None


def model_fingerprint(path: Path) -> str:
    """sha256 of the model's weights (safetensors only) and of every other file beside them (config, tokenizer,
    chat template, generation config)."""
    from posfreq.train.model.hf import hf_model_fingerprint

    try:
        weights = hf_model_fingerprint(path)
    except OSError as err:
        raise RulerError(f"--model {path}: {err}") from None
    others = [f for f in path.iterdir() if f.is_file() and f.suffix not in WEIGHT_SUFFIXES]
    return weights + files_sha256(path, others)


def code_fingerprint() -> dict:
    """What decides a score besides the model and the settings: the evaluation's code (analysis/keys.py's RULER_ENTRIES and
    the task folder) and the versions of the libraries that build, run and score the prompts."""
    from importlib.metadata import version

    libraries = ("lm_eval", "transformers", "torch", "numpy", "datasets", "nltk", "wonderwords")
    return {"files": ruler_code(task_yamls()), **{name: version(name) for name in libraries}}


def data_fingerprint() -> dict:
    """The haystack's essays (checked against their pinned content as they are fetched) and the Punkt sentence
    model trained on them, by content: a changed cache is another input, never a reused part."""
    from posfreq.analysis.ruler_task.offline import PUNKT_LANGUAGE, nltk_data_dir
    from posfreq.train.data.essays import PG_ESSAYS_SHA256, pg_essays_dir

    pg_essays_dir()  # raises for a cache that is not the pinned essays
    model = nltk_data_dir() / "tokenizers" / "punkt_tab" / PUNKT_LANGUAGE
    return {"essays": PG_ESSAYS_SHA256, "punkt": files_sha256(model, sorted(model.iterdir()))}


def reusable_part(file: Path, key: str, log_samples: bool) -> dict | None:
    """A finished (task, length) under the same key (with its samples when they are asked for), or None."""
    try:
        part = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(part, dict) or part.get("key") != key:
        return None
    if log_samples and part.get("samples") is None:
        return None
    return part


def score_rows(
    parts: list[dict], tasks: list[str], lengths: list[int], settings: dict
) -> list[dict]:
    """One row per (task, length): the mean RULER score over its samples; then the mean over tasks."""
    by_unit = {(part["task"], part["length"]): part["scores"] for part in parts}
    rows = []
    for task in tasks:
        for length in lengths:
            scores = by_unit[task, length]
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
    keep = {
        "positions": settings["positions"],
        "position_options": json.dumps(settings["position_options"], sort_keys=True),
    }
    return [{**row, **keep} for row in rows]


def write_outputs(
    out: Path, parts: list[dict], rows: list[dict], settings: dict, log: bool
) -> None:
    """scores.csv, results.json and (if asked) samples_<task>.jsonl, from this run's parts."""
    # Atomic: array tasks of slurm/ruler.sh write into one --out at once (the last job writes the whole table).
    with atomic_open(out / "scores.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    results: dict[str, dict] = {}
    for part in parts:
        results.setdefault(f"posfreq_ruler_{part['task']}", {}).update(part["results"])
    versions = {f"posfreq_ruler_{part['task']}": part["version"] for part in parts}
    summary = {"settings": settings, "results": results, "versions": versions}
    write_json_atomic(out / "results.json", summary, indent=1, default=str)
    if log:
        for task in dict.fromkeys(part["task"] for part in parts):
            with atomic_open(out / f"samples_posfreq_ruler_{task}.jsonl", "w") as handle:
                for part in parts:
                    if part["task"] == task:
                        for entry in part["samples"]:
                            handle.write(json.dumps(entry, default=str) + "\n")


def print_table(rows: list[dict], lengths: list[int]) -> None:
    """Scores in percent, a row per task and a column per length (RULER's layout)."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    score = {(row["task"], row["length"]): row["score"] for row in rows}
    print("task".ljust(16) + "".join(f"{n:>9}" for n in lengths))
    for task in tasks:
        print(task.ljust(16) + "".join(f"{100 * score[task, n]:9.1f}" for n in lengths))
