"""`posfreq doctor`: the first command on a new cluster node, before the first sbatch.

It runs every path a pretraining and a probe take on this machine's hardware, small, and reports
PASS / FAIL / SKIPPED (with the reason), time and peak memory per check, as a table and as
OUT/doctor.json:

- ``environment``: torch, CUDA, GPUs, NCCL, the attention kernels present and what ``auto`` picks;
- ``pretrain-bf16`` / ``pretrain-fp32``: a tiny pretraining on every local GPU (one process per
  GPU over NCCL; one process on gloo without a GPU) with milestones, ``latest`` and validation,
  stopped after 2 steps and continued with ``--resume auto``; its losses, validation losses and
  trained-length histogram must equal an uninterrupted run's;
- ``attention-<backend>``: each attention backend present against sdpa (float32 reference on the
  same inputs): forward, log-sum-exp, fewer queries than keys, a window, and a backward pass;
- ``probe-<backend>``: the tiny checkpoint under rope, string and dca on each backend, teacher-forced
  log-probabilities and greedy answers against sdpa's;
- ``loss``: the training loss (liger's kernel where installed on CUDA) against full logits; on CUDA a
  missing, broken or old liger-kernel fails it (the chunked fallback is correct but slow);
- ``string-hf``: STRING through transformers with float32 weights under bf16 autocast, as the probe runs
  a Hugging Face model on a GPU, against float32, and the attention backend it reaches.

Without a GPU it runs the CPU subset and says which checks were skipped and why. The pretraining
checks run `posfreq pretrain` as child processes (Fabric starts one per GPU itself); SLURM's
variables are kept from them, so a one-task job on one node can run it (slurm/doctor.sh).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from posfreq.train.journal import JOURNAL_FILE, remove_recorded
from posfreq.train.model import attention_kernels
from posfreq.train.outdir import OutputDirError, claim_output_dir, owner_of
from posfreq.train.preflight.checks import (
    CheckResult,
    attention_check,
    environment,
    loss_check,
    probe_check,
    run_check,
    string_hf_check,
)
from posfreq.train.preflight.pretrain_check import pretrain_check, write_tiny_corpus


def run_doctor(out: Path, device: torch.device, expect_gpu: bool = True) -> list[CheckResult]:
    """Every check, in order; the pretraining's checkpoint feeds the probe checks. `expect_gpu`: False for an
    explicit --device cpu, where a GPU torch cannot see is no failure."""
    from posfreq.train.checkpoint import layout as ckpt

    results = [run_check("environment", lambda: environment(device, expect_gpu), device)]
    data = write_tiny_corpus(out / "data")
    processes = torch.cuda.device_count() if device.type == "cuda" else 1
    checkpoint = None
    for precision, label in (("bf16-mixed", "pretrain-bf16"), ("32-true", "pretrain-fp32")):
        results.append(
            run_check(
                label,
                lambda p=precision, n=label: pretrain_check(out / n, data, device, p, processes),
                device,
                children=True,
            )
        )
        run = ckpt.checkpoint_root(out / label / "uninterrupted")
        if checkpoint is None and results[-1].status == "PASS":
            checkpoint = max(run.glob(f"{ckpt.MILESTONE_PREFIX}*"))
    for backend in attention_kernels.KERNELS:
        if backend != "sdpa":
            results.append(
                run_check(
                    f"attention-{backend}", lambda b=backend: attention_check(b, device), device
                )
            )
    for backend in attention_kernels.KERNELS:
        if backend != "sdpa":
            results.append(
                run_check(
                    f"probe-{backend}", lambda b=backend: probe_check(checkpoint, b, device), device
                )
            )
    results.append(run_check("loss", lambda: loss_check(device), device))
    results.append(run_check("string-hf", lambda: string_hf_check(device), device))
    return results


def format_table(results: list[CheckResult]) -> str:
    """The report as aligned text: check, status, seconds, peak memory, detail."""
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  {'status':<7}  {'time':>7}  {'peak':>16}  detail"]
    for r in results:
        peak = (
            f"{r.peak_mib:,.0f} MiB {r.peak_of.split()[0]}"
            if r.peak_mib is not None and r.status != "SKIPPED"
            else "-"
        )
        lines.append(
            f"{r.name:<{width}}  {r.status:<7}  {r.seconds:>6.1f}s  {peak:>16}  {r.detail}"
        )
    return "\n".join(lines)


def claim_work_dir(out: str | None, command: str, parts: tuple[str, ...]) -> Path:
    """`out` (or a new temporary directory) claimed for `command`, its earlier runs in the folders `parts`
    removed (its report is rewritten); OutputDirError for another's directory, untouched."""
    path = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"posfreq-{command}-"))
    claim_output_dir(path, command)
    journal = (path / JOURNAL_FILE).is_file()
    for item in parts:
        part = path / item
        if journal:
            remove_recorded(path, under=item, sub_steps=True)  # the commands it ran there itself
        elif part.is_dir() and not part.is_symlink() and owner_of(part) is not None:
            shutil.rmtree(
                part
            )  # an older doctor's run (no journal then), marked by the command that wrote it
        if part.exists() or part.is_symlink():
            raise OutputDirError(
                f"{part} holds files `posfreq {command}` did not write. Fix: move them out, or pass another "
                "--out (only files this command wrote before were removed)"
            )
    return path


def prepare_out(out: str | None) -> Path:
    """A new or empty directory, or an earlier doctor's (its runs are replaced); another's is refused untouched
    (OutputDirError)."""
    return claim_work_dir(out, "doctor", ("data", "pretrain-bf16", "pretrain-fp32"))


def counts_line(results: list[CheckResult]) -> str:
    """ "N passed, N failed, N skipped" of a report."""
    failed = sum(r.status == "FAIL" for r in results)
    skipped = sum(r.status == "SKIPPED" for r in results)
    return f"{len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped"
