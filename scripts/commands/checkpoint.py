"""`posfreq checkpoint`: list a run's complete checkpoints, or consolidate one into a model directory.

A consolidated model is one directory with ``model.safetensors`` (our state_dict, plain tensors),
``model_config.json``, ``tokenizer_spec.json``, ``trained_lengths.npy`` and ``meta.json`` (the
source's trainer.json plus ``consolidated_from``); `checkpoint.load_model` reads it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal, Optional

from jsonargparse import ArgumentParser

from posfreq.train.checkpoint.consolidate import (
    consolidate,
)
from posfreq.train.checkpoint.layout import checkpoint_root, list_checkpoints
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.command_line import command_parser, parse
from posfreq.train.model.config import DTYPE_ALIASES, DTYPES
from posfreq.train.outdir import OutputDirError


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
        except (OutputDirError, CheckpointError) as err:
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
