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
- ``loss``: the training loss (liger's kernel where installed on CUDA) against full logits.

Without a GPU it runs the CPU subset and says which checks were skipped and why. The pretraining
checks run `posfreq pretrain` as child processes (Fabric starts one per GPU itself); SLURM's
variables are kept from them, so a one-task job on one node can run it (slurm/doctor.sh).
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from posfreq.train import attention_kernels as attention
from posfreq.train.cli import command_parser, parse
from posfreq.train.outdir import OutputDirError, claim_output_dir

L = 128  # the tiny run's training length
SCHEMES = ("rope", "string", "dca")
WORDS = "the cat sat on a mat and then it ran to the red house where a dog slept all day".split()


class Skipped(Exception):
    """A check that cannot run here; the message says why."""


@dataclass
class CheckResult:
    """One row of the report."""

    name: str
    status: str  # PASS, FAIL or SKIPPED
    detail: str
    seconds: float
    peak_mib: float | None
    peak_of: str  # what peak_mib measures: "gpu", "host rss (children)", ...


def _peak_start(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device, children: bool) -> tuple[float | None, str]:
    if device.type == "cuda" and not children:
        return torch.cuda.max_memory_allocated(device) / 2**20, "gpu"
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024, "host rss" + (
        " (children)" if children else ""
    )


def run_check(
    name: str, body: Callable[[], str], device: torch.device, children: bool = False
) -> CheckResult:
    """Run one check: PASS with its detail line, SKIPPED with the reason, FAIL with the error's last line."""
    _peak_start(device)
    started = time.perf_counter()
    try:
        status, detail = "PASS", body()
    except Skipped as why:
        status, detail = "SKIPPED", str(why)
    except Exception as err:  # a check's failure is a result, reported with the rest
        status, detail = (
            "FAIL",
            f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}",
        )
        if os.environ.get("POSFREQ_DEBUG"):
            traceback.print_exc()
    peak, of = _peak(device, children)
    return CheckResult(name, status, detail, time.perf_counter() - started, peak, of)


# ------------------------------------------------------------------ environment


def environment(device: torch.device) -> str:
    """Versions, GPUs, and per backend whether it is present and what auto picks for training."""
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if device.type == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        parts += [
            f"{torch.cuda.device_count()} x {', '.join(names)}",
            f"CUDA {torch.version.cuda}",
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
        ]
    else:
        parts.append("no CUDA GPU")
    present = [n for n in attention.KERNELS if attention.kernel_present(n)]
    parts.append(f"kernels present: {', '.join(present)}")
    for dtype in (torch.bfloat16, torch.float32):
        _, why = attention.explain_backend("auto", device, dtype, backward=True)
        parts.append(f"training in {str(dtype).removeprefix('torch.')}: {why}")
    return "; ".join(parts)


# ------------------------------------------------------------------ tiny pretraining, interrupted and resumed


def write_tiny_corpus(directory: Path, max_words: int = 60) -> Path:
    """Two byte-tokenized shards of 150 short, learnable synthetic documents each (1 to max_words - 1 words)."""
    from posfreq.train.shards import ShardWriter

    rng = np.random.default_rng(0)
    for s in range(2):
        with ShardWriter(
            directory, f"shard-{s:03d}", tokenizer="bytes", vocab_size=258, eos_id=257
        ) as writer:
            for d in range(150):
                n = int(rng.integers(1, max_words))
                text = " ".join(WORDS[(3 * i + d) % len(WORDS)] for i in range(n)) + "."
                writer.add(list(text.encode()) + [257])
    return directory


def tiny_run_config(
    data: Path, out: Path, device: torch.device, precision: str, processes: int
) -> dict:
    """4 optimizer steps of 2 micro-batches per process; a milestone, a validation and a `latest` every 2 steps."""
    rows = (
        2 * processes
    )  # one row per micro-batch and process, 2 micro-batches (exercises no_backward_sync)
    step_tokens = rows * L
    return {
        "out": str(out),
        "seed": 1,
        "total_tokens": 4 * step_tokens,
        "global_batch_tokens": step_tokens,
        "micro_batch_rows": 1,
        "accelerator": device.type,
        "devices": processes,
        "precision": precision,
        "resume": "auto",
        "model": {
            "preset": "tiny-2l-128",
            "overrides": {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256},
        },
        "data": {
            "dir": str(data),
            "train_len": L,
            "val_dir": str(data),
            "val_rows": 2 * processes,
            "val_every_tokens": 2 * step_tokens,
        },
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1},
        "checkpoint": {
            "every_tokens": 2 * step_tokens,
            "latest_every_steps": 1,
            "latest_every_minutes": 0,
        },
        "logging": {"progress_bar": False},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(config: dict, path: Path, *extra: str) -> None:
    """`posfreq pretrain --config PATH` in a child process (Fabric starts the other local ranks from it)."""
    path.write_text(json.dumps(config))
    launcher = (
        "SLURM_",
        "TORCHELASTIC_",
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )  # a local launch by Fabric, not srun's or torchrun's
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "posfreq.train.pretrain", "--config", str(path), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    (path.parent / f"{path.stem}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
        raise RuntimeError(
            f"posfreq pretrain exited {proc.returncode} (log: {path.parent / (path.stem + '.log')}): "
            f"{lines[-1] if lines else ''}"
        )


def _metrics(run: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r], [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


def pretrain_check(
    work: Path, data: Path, device: torch.device, precision: str, processes: int
) -> str:
    """The tiny run uninterrupted, and stopped at step 2 then resumed: same losses, validation and histogram."""
    from posfreq.train import checkpoint as ckpt

    work.mkdir(parents=True)
    whole, split = work / "uninterrupted", work / "resumed"
    run_pretrain(
        tiny_run_config(data, whole, device, precision, processes), work / "uninterrupted.json"
    )
    config = tiny_run_config(data, split, device, precision, processes)
    run_pretrain(config, work / "resumed.json", "--stop-at-step", "2")
    if not (split / "checkpoints" / ckpt.LATEST).is_dir():
        raise AssertionError("the run stopped at step 2 wrote no checkpoints/latest")
    run_pretrain(config, work / "resumed.json")
    (loss_a, val_a), (loss_b, val_b) = _metrics(whole), _metrics(split)
    if len(loss_a) != 4 or len(loss_b) != 4 or len(val_a) != 2 or len(val_b) != 2:
        raise AssertionError(
            f"expected 4 steps and 2 validations, got {len(loss_a)}/{len(val_a)} uninterrupted, "
            f"{len(loss_b)}/{len(val_b)} resumed"
        )
    # Bitwise on CPU; on GPUs FlashAttention's backward accumulates with atomics, so runs differ in the last bits.
    tolerance = 0.0 if device.type == "cpu" else 1e-3
    worst = max(abs(a - b) / abs(a) for a, b in zip(loss_a + val_a, loss_b + val_b))
    if not all(map(math.isfinite, loss_a + val_a)) or worst > tolerance:
        raise AssertionError(
            f"resumed losses {loss_b} / val {val_b} differ from uninterrupted {loss_a} / val {val_a} "
            f"(max relative difference {worst:.2e} > {tolerance:g})"
        )
    end = ckpt.milestone_name(config["total_tokens"])
    if not np.array_equal(
        ckpt.load_trained_lengths(whole / "checkpoints" / end),
        ckpt.load_trained_lengths(split / "checkpoints" / end),
    ):
        raise AssertionError(f"trained-length histograms of {end} differ between the two runs")
    return (
        f"{processes} process(es), {precision}: losses {', '.join(f'{x:.4f}' for x in loss_a)}; resumed at "
        f"step 2, max relative difference {worst:.1e}; histograms equal"
    )


# ------------------------------------------------------------------ attention backends against sdpa


def _packed(
    lens: list[int], heads: int, dim: int, seed: int, device: torch.device, dtype: torch.dtype
):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lens), heads, dim, generator=g).to(device=device, dtype=dtype)


def _cu(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=device)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """Max abs difference of finite entries; AssertionError naming `name` beyond tol (or where -inf differs)."""
    got, want = got.float(), want.float()
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        raise AssertionError(f"{name}: -inf at different places")
    finite = torch.isfinite(want)
    diff = float((got[finite] - want[finite]).abs().max()) if bool(finite.any()) else 0.0
    if diff > tol * (1 + float(want[finite].abs().max())):
        raise AssertionError(
            f"{name}: max difference {diff:.3g} > {tol:g} (relative to the largest value)"
        )
    return diff


def _require(backend: str, device: torch.device) -> None:
    """Skipped (saying why) unless `backend`'s kernel is present and runs on `device`."""
    if backend not in attention.available_backends(device):
        raise Skipped(
            f"{backend} is not available on {device.type}: "
            f"{attention.why_not(backend, device.type, torch.bfloat16) or 'not present'}"
        )


def attention_check(backend: str, device: torch.device) -> str:
    """`backend` against sdpa in float32 on the same inputs: forward, lse, Lq < Lk, window, backward."""
    _require(backend, device)
    kernel = attention.KERNELS[backend]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    done, skipped = [], []
    cases = [
        ("forward", [100, 3, 257, 64], [100, 3, 257, 64], None, False),
        ("lse", [100, 3, 257, 64], [100, 3, 257, 64], None, True),
        ("fewer queries than keys", [1, 17, 64], [50, 17, 300], None, kernel.lse),
        ("window", [1, 40, 200], [50, 40, 300], 32, kernel.lse),
    ]
    for label, lens_q, lens_k, window, lse in cases:
        if label == "lse" and not kernel.lse:
            skipped.append("lse (this kernel returns none)")
            continue
        q, k, v = (
            _packed(lens, h, 64, s, device, dtype)
            for lens, h, s in ((lens_q, 8, 1), (lens_k, 2, 2), (lens_k, 2, 3))
        )
        args = (_cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k))
        with torch.no_grad():
            got = attention.varlen_attention(
                q, k, v, *args, window=window, return_lse=lse, backend=backend
            )
            want = attention.varlen_attention(
                q.float(),
                k.float(),
                v.float(),
                *args,
                window=window,
                return_lse=lse,
                backend="sdpa",
            )
        if lse:
            _close(f"{label} output", got[0], want[0], tol)
            _close(f"{label} log-sum-exp", got[1], want[1], tol)
        else:
            _close(f"{label} output", got, want, tol)
        done.append(label)
    if device.type in kernel.backward_devices:
        lens = [100, 3, 257, 64]
        leaves = [
            _packed(lens, h, 64, s, device, dtype).requires_grad_()
            for h, s in ((8, 4), (2, 5), (2, 6))
        ]
        refs = [x.detach().float().requires_grad_() for x in leaves]
        weight = _packed(lens, 8, 64, 7, device, torch.float32)
        for inputs, name in ((leaves, backend), (refs, "sdpa")):
            out = attention.varlen_attention(
                *inputs, _cu(lens, device), _cu(lens, device), 257, 257, backend=name
            )
            (out.float() * weight).sum().backward()
        for x, ref, label in zip(leaves, refs, "qkv"):
            _close(f"d{label}", x.grad, ref.grad, 5e-2 if dtype == torch.bfloat16 else 1e-4)
        done.append("backward")
    else:
        skipped.append(f"backward (none on {device.type})")
    return f"{str(dtype).removeprefix('torch.')}: {', '.join(done)} equal sdpa's" + (
        f"; not checked: {', '.join(skipped)}" if skipped else ""
    )


# ------------------------------------------------------------------ the probe's model paths on each backend


def probe_check(checkpoint: Path | None, backend: str, device: torch.device) -> str:
    """Teacher-forced log-probs and greedy answers of the tiny checkpoint under rope/string/dca: backend vs sdpa."""
    import contextlib

    from posfreq.train.checkpoint import load_model

    if checkpoint is None:
        raise Skipped("no tiny checkpoint (the pretraining check did not pass)")
    _require(backend, device)
    precision = "bfloat16" if device.type == "cuda" else "float32"
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    if attention.why_not(backend, device.type, dtype, return_lse=True) is not None:
        raise Skipped(
            f"{backend}: {attention.why_not(backend, device.type, dtype, return_lse=True)} "
            "(string and dca merge two passes by it)"
        )
    model = load_model(checkpoint, device="cpu", dtype=torch.float32)[0].to(device)
    prompts = torch.randint(0, 256, (2, 2 * L), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    report = []
    for scheme in SCHEMES:
        model.set_positions(scheme)
        results = {}
        for name in (backend, "sdpa"):
            model.attention_backend = name
            cast = (
                torch.autocast(device.type, dtype=dtype)
                if dtype != torch.float32
                else contextlib.nullcontext()
            )
            with (
                torch.inference_mode(),
                cast,
            ):  # as the probe runs: bf16 autocast over float32 weights on a GPU
                logprobs, _ = model.target_logprobs(prompts, L // 2)
                answers = model.generate(prompts, 8)
            results[name] = logprobs.float().cpu(), answers
        diff = _close(f"{scheme} log-probs", results[backend][0], results["sdpa"][0], tol)
        same = sum(a == b for a, b in zip(results[backend][1], results["sdpa"][1]))
        report.append(f"{scheme} {diff:.1e} ({same}/2 answers equal)")
    return f"{precision}, max log-prob difference: " + "; ".join(report)


# ------------------------------------------------------------------ the loss


def loss_check(device: torch.device) -> str:
    """linear_cross_entropy (liger on CUDA when installed) against F.cross_entropy of full logits: loss and grads."""
    from posfreq.train.loss import _liger_loss, linear_cross_entropy, uses_liger

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(1000, 64, generator=g) * 0.1).to(device, dtype).requires_grad_()
    targets = torch.randint(0, 1000, (300,), generator=g).to(device)
    targets[::7] = -100
    kernel = "liger" if uses_liger(device.type, True) and _liger_loss() is not None else "chunked"
    lean = linear_cross_entropy(hidden, weight, targets)
    lean_grads = torch.autograd.grad(lean, (hidden, weight))
    plain = F.cross_entropy(
        hidden.float() @ weight.float().T, targets, ignore_index=-100, reduction="sum"
    )
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    _close("loss", lean.detach(), plain.detach(), tol)
    for got, want, name in zip(lean_grads, plain_grads, ("d hidden", "d weight")):
        _close(name, got, want, tol)
    return f"{kernel} kernel, {str(dtype).removeprefix('torch.')}: loss {float(lean.detach()):.4f} and gradients equal full logits'"


# ------------------------------------------------------------------ the report


def run_doctor(out: Path, device: torch.device) -> list[CheckResult]:
    """Every check, in order; the pretraining's checkpoint feeds the probe checks."""
    from posfreq.train import checkpoint as ckpt

    results = [run_check("environment", lambda: environment(device), device)]
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
        run = out / label / "uninterrupted" / ckpt.CHECKPOINTS
        if checkpoint is None and results[-1].status == "PASS":
            checkpoint = max(run.glob("tokens-*"))
    for backend in attention.KERNELS:
        if backend != "sdpa":
            results.append(
                run_check(
                    f"attention-{backend}", lambda b=backend: attention_check(b, device), device
                )
            )
    for backend in attention.KERNELS:
        if backend != "sdpa":
            results.append(
                run_check(
                    f"probe-{backend}", lambda b=backend: probe_check(checkpoint, b, device), device
                )
            )
    results.append(run_check("loss", lambda: loss_check(device), device))
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


def prepare_out(out: str | None) -> Path:
    """A new or empty directory, or an earlier doctor's (its runs are replaced); another's is refused untouched."""
    path = Path(out) if out else Path(tempfile.mkdtemp(prefix="posfreq-doctor-"))
    try:
        claim_output_dir(path, "doctor")
    except OutputDirError as err:
        raise SystemExit(f"error: {err}") from None
    for item in (
        "data",
        "pretrain-bf16",
        "pretrain-fp32",
    ):  # an earlier doctor's runs (the report is rewritten)
        shutil.rmtree(path / item, ignore_errors=True)
    return path


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
        type=str,
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="Where to run the checks: auto is cuda when a GPU is visible.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print the table, write OUT/doctor.json; exit 1 if any check failed."""
    args = parse(build_parser(), argv)
    kind = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if kind == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "error: --device cuda, but torch sees no CUDA GPU. Fix: run on a GPU node, or use --device cpu"
        )
    out = prepare_out(args.out)
    started = time.perf_counter()
    results = run_doctor(out, torch.device(kind))
    report = {
        "device": kind,
        "seconds": time.perf_counter() - started,
        "checks": [asdict(r) for r in results],
    }
    (out / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(results))
    failed = [r.name for r in results if r.status == "FAIL"]
    skipped = [r.name for r in results if r.status == "SKIPPED"]
    print(
        f"\n{len(results) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped "
        f"in {report['seconds']:.0f} s; report: {out / 'doctor.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
