"""`make gpu-check`: everything CUDA this code base has, on one GPU, offline, within RUN_SECONDS, as one table and
one JSON.

Stages of a plain run, the most telling first, each with a time budget (a stage past it fails and the next one
runs; one not started within the run's seconds is skipped, named):

- ``environment``: GPU, driver, torch, CUDA, the architectures the wheel was built for, the kernels present, the
  installed `varlen_attn`'s signature, liger-kernel's state, and what ``auto`` picks;
- the doctor's single-GPU checks: ``attention-<backend>`` and ``probe-<backend>`` (rope, string, dca) against
  sdpa, and ``loss`` (liger against full logits); ``string-hf``: STRING through transformers under bf16 autocast;
- ``varlen-native-gqa``: whether this torch's varlen kernel takes grouped key/value heads without copies;
- ``varlen-repeatable``: whether per-document attention's backward is bitwise repeatable at 8 x 2048 tokens;
- ``train-1.3b``: tinyllama-1.3b at L = 2048 through one rank's real accumulation loop (16 micro-batches of the
  pretraining config's 8 rows), a stop with the sharded save at step 2 and a resume: step time, MFU against the
  datasheet peak and against the measured bf16 matmul rate, peak memory, save and load times against the 300 s
  USR1 margin;
- ``string-prefill-32k``: STRING against the fastest RoPE prefill at 32K tokens on SmolLM-135M's shape;
- ``slurm-requeue``: one task under Lightning's SLURMEnvironment and NCCL with fake SLURM variables, a SIGUSR1,
  the `scontrol requeue` it asks of a fake, and the requeued job's losses against an uninterrupted run.

By name only (``--only``): ``train-1.3b-eager``, ``pretrain-bf16`` (the doctor's tiny run stopped and resumed)
and ``block-compile`` (one 1.3B block, eager against `torch.compile`).

Without a GPU it runs what it can (environment, loss, string-hf on the CPU), names every stage it skipped,
and exits 0. With one, it exits 1 if any stage failed. docs/cluster.md records the tables it printed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from posfreq.train.atomic import write_json_atomic
from posfreq.train.model import attention_kernels
from posfreq.train.preflight.checks import (
    CheckResult,
    attention_check,
    loss_check,
    probe_check,
    run_check,
    string_hf_check,
)
from posfreq.train.preflight.gpu_kernels import (
    block_compile_stage,
    environment_stage,
    gpu_only,
    prefill_stage,
    varlen_gqa_stage,
    varlen_repeatability_stage,
)
from posfreq.train.preflight.gpu_training import TrainStageSize, train_stage


class StageTimeout(BaseException):
    """A stage past its budget: a BaseException, so that a stage's own `except Exception` cannot take it for a
    finding (`bounded` turns it into the stage's failure)."""


@contextlib.contextmanager
def time_budget(seconds: float):
    """Raise StageTimeout in the main thread once `seconds` have passed (checked between Python operations)."""

    def expire(signum, frame):
        raise StageTimeout(f"over its budget of {seconds:.0f} s")

    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def within_budget(body: Callable[[], str], budget: float) -> str:
    """body(), or TimeoutError once `budget` seconds have passed, whatever the body catches."""
    try:
        with time_budget(budget):
            return body()
    except StageTimeout as late:
        raise TimeoutError(str(late)) from None


RUN_SECONDS = 480
"""One `make gpu-check` fits 8 minutes (of a 15-minute device budget, starts included, with room to rerun): a stage
is given what is left of them at most, and one not started by then is skipped, named."""


def stages(device: torch.device, out: Path) -> list[tuple[str, float, Callable[[], str], bool]]:
    """(name, budget in seconds, body, whether a plain run runs it) in order, the most telling first so that a run
    cut short still answers them; the others run when `--only` names them. The probe stages use the SLURM stage's
    uninterrupted checkpoint."""
    from posfreq.train.checkpoint import layout as ckpt
    from posfreq.train.preflight.pretrain_check import (
        pretrain_check,
        requeue_check,
        write_tiny_corpus,
    )

    made: dict[str, object] = {}

    def tiny_run(name: str, check: Callable[[Path, Path], str]) -> str:
        gpu_only(device)
        data = write_tiny_corpus(out / "data") if not (out / "data").is_dir() else out / "data"
        detail = check(out / name, data)
        run = ckpt.checkpoint_root(out / name / "uninterrupted")
        made["checkpoint"] = max(run.glob(f"{ckpt.MILESTONE_PREFIX}*"))
        return detail

    def probe(backend: str) -> str:
        gpu_only(device)
        return probe_check(made.get("checkpoint"), backend, device)

    def train(compile: str) -> str:
        gpu_only(device)
        shutil.rmtree(out / "train-1.3b", ignore_errors=True)
        result = train_stage(device, out / "train-1.3b", TrainStageSize(compile=compile))
        made[f"train-{compile}"] = result
        if "train-off" in made and "train-auto" in made:
            gain = made["train-auto"]["tokens_per_s"] / made["train-off"]["tokens_per_s"]
            return result["detail"] + f"; model.compile auto is {gain:.2f}x this"
        return result["detail"]

    backends = [b for b in attention_kernels.KERNELS if b != "sdpa"]
    return [
        ("environment", 30, lambda: environment_stage(device), True),
        *[(f"attention-{b}", 40, lambda b=b: attention_check(b, device), True) for b in backends],
        ("loss", 30, lambda: loss_check(device), True),
        ("string-hf", 30, lambda: string_hf_check(device), True),
        ("varlen-native-gqa", 20, lambda: varlen_gqa_stage(device), True),
        (
            "varlen-repeatable",
            30,
            lambda: gpu_only(device) or varlen_repeatability_stage(device),
            True,
        ),
        ("train-1.3b", 240, lambda: train("auto"), True),
        (
            "string-prefill-32k",
            60,
            lambda: gpu_only(device) or prefill_stage(device, profile=out / "string_profile.txt"),
            True,
        ),
        (
            "slurm-requeue",
            150,
            lambda: tiny_run(
                "slurm-requeue", lambda work, data: requeue_check(work, data, device, "bf16-mixed")
            ),
            True,
        ),
        *[(f"probe-{b}", 30, lambda b=b: probe(b), True) for b in backends],
        # beyond the 8 minutes: by name only
        ("train-1.3b-eager", 180, lambda: train("off"), False),
        (
            "pretrain-bf16",
            240,
            lambda: tiny_run(
                "pretrain-bf16",
                lambda work, data: pretrain_check(work, data, device, "bf16-mixed", 1),
            ),
            False,
        ),
        ("block-compile", 150, lambda: gpu_only(device) or block_compile_stage(device), False),
    ]


def run_stages(
    device: torch.device, out: Path, report: Path, only: set[str] | None
) -> list[CheckResult]:
    """Run the plain run's stages (or those in `only`) within RUN_SECONDS, printing each row as it ends and
    rewriting `report` after each."""
    from posfreq.train.preflight.doctor import format_table

    results: list[CheckResult] = []
    started = time.perf_counter()
    for name, budget, body, default in stages(device, out):
        if (only and name not in only) or (not only and not default):
            continue
        left = RUN_SECONDS - (time.perf_counter() - started)
        if left < 5:
            results.append(
                CheckResult(
                    name,
                    "SKIPPED",
                    f"the run's {RUN_SECONDS} s were spent before it",
                    0.0,
                    None,
                    "",
                )
            )
        else:
            bounded = functools.partial(within_budget, body, min(budget, left))
            results.append(
                run_check(
                    name, bounded, device, children=name in ("pretrain-bf16", "slurm-requeue")
                )
            )
        print(format_table(results).splitlines()[-1], flush=True)
        write_json_atomic(
            report,
            {
                "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "seconds": time.perf_counter() - started,
                "stages": [asdict(r) for r in results],
            },
            indent=2,
        )
    return results


def is_report_or_new(path: Path) -> bool:
    """Whether `path` may be (re)written as the report: it does not exist, or an earlier run of this wrote it."""
    if not path.exists() and not path.is_symlink():
        return True
    try:
        earlier = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(earlier, dict) and {"stages", "torch", "device"} <= set(earlier)


def main(argv: list[str] | None = None) -> int:
    """Run the stages; print the table; exit 1 if a stage failed."""
    import argparse

    from posfreq.train.outdir import OutputDirError
    from posfreq.train.preflight.doctor import claim_work_dir, counts_line, format_table

    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default=None, help="work folder (new, empty or an earlier gpu-check's)"
    )
    parser.add_argument(
        "--json", default=None, help="the report's path (default: OUT/gpu_check.json)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these stages")
    args = parser.parse_args(argv)
    if args.json and not is_report_or_new(Path(args.json)):  # before anything is claimed or written
        print(
            f"error: --json {args.json} exists and is not an earlier gpu-check report; it was left as it "
            "is. Fix: name a new file",
            file=sys.stderr,
        )
        return 2
    try:
        out = claim_work_dir(
            args.out, "gpu-check", ("data", "pretrain-bf16", "slurm-requeue", "train-1.3b")
        )
    except OutputDirError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = Path(args.json) if args.json else out / "gpu_check.json"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    print(f"posfreq gpu-check on {device}; report: {report}", flush=True)
    results = run_stages(device, out, report, set(args.only) if args.only else None)
    print("\n" + format_table(results))
    print(f"\n{counts_line(results)}; report: {report}")
    skipped = [r.name for r in results if r.status == "SKIPPED"]
    if skipped:
        print("skipped: " + ", ".join(skipped))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
