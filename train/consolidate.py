"""`posfreq checkpoint`: list a run's complete checkpoints, or consolidate one into a model directory.

A consolidated model is one directory with ``model.safetensors`` (our state_dict, plain tensors),
``model_config.json``, ``tokenizer_spec.json``, ``trained_lengths.npy`` and ``meta.json`` (the
source's trainer.json plus ``consolidated_from``); `checkpoint.load_model` reads it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Literal, Optional

import torch
from jsonargparse import ArgumentParser

from posfreq.train import atomic
from posfreq.train.atomic import write_json_atomic
from posfreq.train.checkpoint import (
    CONSOLIDATED_WEIGHTS,
    LENGTHS_FILE,
    META_FILE,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILE,
    TRAINER_FILE,
    checkpoint_root,
    list_checkpoints,
    model_state_dict,
)
from posfreq.train.checkpoint_save import write_weights
from posfreq.train.command_line import command_parser, parse
from posfreq.train.config import DTYPE_ALIASES, DTYPES
from posfreq.train.outdir import OutputDirError, check_output_dir, claim_output_dir, entry_names

CONSOLIDATE = "checkpoint consolidate"


def consolidate(
    checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write one trainer checkpoint as a single-file model directory (atomically); returns it.

    `out_dir` must be new, empty or an earlier consolidation (OutputDirError otherwise: never a run directory).
    """
    src, out = Path(checkpoint_dir), Path(out_dir)
    tmp, old = atomic.temporary(out), out.with_name(out.name + ".old")
    check_output_dir(out, CONSOLIDATE, written_before=_earlier_consolidation)
    # publish_dir() replaces them: only an interrupted consolidation's own may go
    for sibling in (tmp, old):
        check_output_dir(sibling, CONSOLIDATE, flag="--out's temporary")
    # before anything is written: a wrong --checkpoint leaves nothing behind
    state = model_state_dict(src)
    if tmp.exists():
        shutil.rmtree(tmp)
    claim_output_dir(tmp, CONSOLIDATE)
    try:
        write_weights(state, tmp / CONSOLIDATED_WEIGHTS, dtype)
        for name in (MODEL_CONFIG_FILE, TOKENIZER_FILE, LENGTHS_FILE):
            shutil.copyfile(src / name, tmp / name)
        meta = (
            json.loads((src / TRAINER_FILE).read_text()) if (src / TRAINER_FILE).is_file() else {}
        )
        meta["consolidated_from"] = str(src.resolve())
        write_json_atomic(tmp / META_FILE, meta, indent=1, sort_keys=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # this call's own temporary
        raise
    atomic.publish_dir(tmp, out)
    return out


CONSOLIDATED_FILES = {
    CONSOLIDATED_WEIGHTS,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILE,
    LENGTHS_FILE,
    META_FILE,
}


def _earlier_consolidation(out: Path) -> bool:
    """Whether an older posfreq consolidated into `out`: exactly its files, meta.json naming the source."""
    if entry_names(out) != CONSOLIDATED_FILES:
        return False
    try:
        return "consolidated_from" in json.loads((out / META_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


def build_parser() -> ArgumentParser:
    """`posfreq checkpoint`: the subcommands `consolidate` and `list`."""
    parser = command_parser(
        "posfreq checkpoint",
        "List a run's complete checkpoints, or consolidate one into a "
        "model directory (model.safetensors and its config files).",
    )
    consolidate_parser = command_parser(
        "posfreq checkpoint consolidate",
        "Write a trainer checkpoint's weights as "
        "model.safetensors, with its config files, into a new directory (atomically).",
    )
    consolidate_parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="A trainer checkpoint directory (RUN/checkpoints/tokens-*/ or latest/).",
    )
    consolidate_parser.add_argument(
        "--out", type=Path, required=True, help="The model directory to write."
    )
    consolidate_parser.add_argument(
        "--dtype",
        type=Optional[Literal[tuple(DTYPES) + tuple(DTYPE_ALIASES)]],
        default=None,
        help="Cast the floating-point weights to this dtype (null: keep the trained one).",
    )
    list_parser = command_parser(
        "posfreq checkpoint list",
        "One line per complete checkpoint of a run: its path, "
        "step, tokens seen, and whether it is resumable or weights only.",
    )
    list_parser.add_argument(
        "--run", type=Path, required=True, help="A training run directory (the trainer's --out)."
    )
    subcommands = parser.add_subcommands(dest="command")
    subcommands.add_subcommand(
        "consolidate", consolidate_parser, help="consolidate a checkpoint into model.safetensors"
    )
    subcommands.add_subcommand("list", list_parser, help="list the complete checkpoints of a run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`posfreq checkpoint consolidate --checkpoint CKPT --out DIR [--dtype bfloat16]` or `list --run RUN`."""
    args = parse(build_parser(), argv)
    if args.command == "consolidate":
        cmd = args.consolidate
        try:
            print(
                consolidate(
                    cmd.checkpoint, cmd.out, DTYPES.get(DTYPE_ALIASES.get(cmd.dtype, cmd.dtype))
                )
            )
        except OutputDirError as err:
            sys.exit(f"error: {err}")
    else:
        run = args.list.run
        if not run.is_dir():
            sys.exit(
                f"error: --run {run} does not exist. Fix: pass a training run directory (the trainer's --out)"
            )
        found = list_checkpoints(run)
        if not found:
            print(f"{run}: no complete checkpoint under {checkpoint_root(run)}", file=sys.stderr)
        for path, meta in found:
            kind = "resumable" if meta.get("resumable") else "weights only"
            print(f"{path}\tstep {meta['step']}\ttokens {meta['run_tokens']}\t{kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
