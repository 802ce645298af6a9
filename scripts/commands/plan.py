"""`posfreq plan`: parameters, per-GPU memory under FSDP2, batch geometry and days to the budget of a pretraining run,
before submitting it (the estimates: train/preflight/plan.py).

    posfreq plan --config configs/pretrain_2k.yaml --gpu a100-80gb --nodes 2 --gpus-per-node 8
"""

from __future__ import annotations

import sys
from dataclasses import fields
from typing import Sequence

from jsonargparse import ArgumentParser

from posfreq.train.command_line import parse
from posfreq.train.preflight.plan import GpuName, report
from posfreq.train.run.config import ConfigError, TrainConfig, config_from_dict
from posfreq.train.run.config import build_parser as train_parser


def build_parser() -> ArgumentParser:
    """`posfreq plan`: the trainer's own parser (a run config and every flag of `posfreq pretrain`), the GPU and MFU."""
    parser = train_parser()
    parser.prog = "posfreq plan"
    parser.description = (
        "Plan a pretraining job before it waits in a queue: parameters, per-GPU memory under FSDP2 with and without "
        "activation checkpointing, fit, largest micro-batch, gradient accumulation, step time and days at an MFU. "
        "Takes the run config and every flag of posfreq pretrain, read as the trainer reads them; the cluster is "
        "--num-nodes nodes of --devices GPUs each."
    )
    group = parser.add_argument_group("The plan's own options")
    group.add_argument(
        "--gpu", type=GpuName, default="a100-80gb", help="The GPU: its peak bf16 FLOP/s and memory."
    )
    group.add_argument(
        "--mfu",
        type=float | None,
        default=None,
        help="Model FLOPs utilisation for the step time and days, in (0, 1], besides the GPU's own figure "
        "(measured by make gpu-check where posfreq has run on that GPU, else assumed; the plan says which).",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan of the run config and flags in `argv` (exit 1 with `error: ...` for a config that cannot work)."""
    parser = build_parser()
    args = parse(parser, argv)
    if args.mfu is not None and not 0 < args.mfu <= 1:
        parser.error(f"--mfu must be in (0, 1], got {args.mfu}")
    values = args.as_dict()
    try:
        cfg = config_from_dict(
            {f.name: values[f.name] for f in fields(TrainConfig)}, where="run config and flags"
        )
        if not isinstance(cfg.devices, int):
            raise ConfigError("devices is 'auto': give --devices, the GPUs per node")
        print(report(cfg, cfg.num_nodes, cfg.devices, args.gpu, args.mfu))
    except ConfigError as err:
        sys.exit(f"error: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
