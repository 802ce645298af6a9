"""`posfreq doctor`: the first command on a new cluster node, before the first sbatch (the checks:
train/preflight/doctor.py and checks.py)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Literal

from posfreq.train.atomic import write_json_atomic
from posfreq.train.command_line import command_parser, parse
from posfreq.train.devices import resolve_device
from posfreq.train.outdir import OutputDirError
from posfreq.train.preflight.doctor import counts_line, format_table, prepare_out, run_doctor


def build_parser():
    """`posfreq doctor`'s parser."""
    parser = command_parser(
        "posfreq doctor",
        "Smoke-test this machine's GPU paths (pretraining over NCCL, every "
        "attention backend, the probe, the loss) in minutes; without a GPU, the CPU subset.",
    )
    parser.add_argument(
        "--out",
        type=str | None,
        default=None,
        help="Directory for the tiny runs and doctor.json (new, empty, or an earlier doctor's); "
        "default: a new temporary directory.",
    )
    parser.add_argument(
        "--device",
        type=Literal["auto", "cpu", "cuda"],
        default="auto",
        help="Where to run the checks: auto is cuda when a GPU is visible.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print the table, write OUT/doctor.json; exit 1 if any check failed."""
    args = parse(build_parser(), argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        sys.exit(f"error: {err}")
    try:
        out = prepare_out(args.out)
    except OutputDirError as err:
        sys.exit(f"error: {err}")
    started = time.perf_counter()
    results = run_doctor(out, device, expect_gpu=args.device != "cpu")
    report = {
        "device": str(device),
        "seconds": time.perf_counter() - started,
        "checks": [asdict(r) for r in results],
    }
    write_json_atomic(out / "doctor.json", report, indent=2)
    print(format_table(results))
    print(f"\n{counts_line(results)} in {report['seconds']:.0f} s; report: {out / 'doctor.json'}")
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
