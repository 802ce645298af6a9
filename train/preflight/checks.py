"""The doctor's checks and their harness: each check returns a detail line, raises Skipped with the reason, or fails;
`run_check` times it and records its peak memory. The pretraining check is train/preflight/pretrain_check.py."""

from __future__ import annotations

import os
import platform
import resource
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from posfreq.train.devices import gpu_visibility_problem
from posfreq.train.model import attention_kernels
from posfreq.train.model.attention import varlen_attention
from posfreq.train.preflight.pretrain_check import L  # the tiny run's training length

SCHEMES = ("rope", "string", "dca")


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


def environment(device: torch.device, expect_gpu: bool = True) -> str:
    """Versions, GPUs, and per backend whether it is present and what auto picks for training; without a GPU
    where one was asked for or is on the node (`expect_gpu`), why torch sees none fails the check."""
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if device.type == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        parts += [
            f"{torch.cuda.device_count()} x {', '.join(names)}",
            f"CUDA {torch.version.cuda}",
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
        ]
    else:
        problem = gpu_visibility_problem() if expect_gpu else None
        if problem:  # a GPU node whose torch cannot use its GPU: the first thing to fix
            raise AssertionError(problem)
        parts.append("no CUDA GPU")
    present = [n for n in attention_kernels.KERNELS if attention_kernels.kernel_present(n)]
    parts.append(f"kernels present: {', '.join(present)}")
    for dtype in (torch.bfloat16, torch.float32):
        _, why = attention_kernels.explain_backend("auto", device, dtype, backward=True)
        parts.append(f"training in {str(dtype).removeprefix('torch.')}: {why}")
    return "; ".join(parts)


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
    if backend not in attention_kernels.available_backends(device):
        raise Skipped(
            f"{backend} is not available on {device.type}: "
            f"{attention_kernels.why_not(backend, device.type, torch.bfloat16) or 'not present'}"
        )


def attention_check(backend: str, device: torch.device) -> str:
    """`backend` against sdpa in float32 on the same inputs: forward, lse, Lq < Lk, window, backward."""
    _require(backend, device)
    kernel = attention_kernels.KERNELS[backend]
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
        reason = attention_kernels.why_not(
            backend, device.type, dtype, return_lse=lse, window=window is not None
        )
        if reason is not None:
            skipped.append(f"{label} ({reason})")
            continue
        q, k, v = (
            _packed(lens, h, 64, s, device, dtype)
            for lens, h, s in ((lens_q, 8, 1), (lens_k, 2, 2), (lens_k, 2, 3))
        )
        args = (_cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k))
        with torch.no_grad():
            got = varlen_attention(q, k, v, *args, window=window, return_lse=lse, backend=backend)
            want = varlen_attention(
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
            out = varlen_attention(
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


def probe_check(checkpoint: Path | None, backend: str, device: torch.device) -> str:
    """Teacher-forced log-probs and greedy answers of the tiny checkpoint under rope/string/dca: backend vs sdpa."""
    import contextlib

    from posfreq.train.checkpoint.load import load_model

    if checkpoint is None:
        raise Skipped("no tiny checkpoint (the pretraining check did not pass)")
    _require(backend, device)
    precision = "bfloat16" if device.type == "cuda" else "float32"
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    reason = attention_kernels.why_not(backend, device.type, dtype, return_lse=True, window=True)
    if reason is not None:
        raise Skipped(
            f"{backend}: {reason} (string and dca merge a windowed pass and a far pass by it)"
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


def loss_check(device: torch.device) -> str:
    """linear_cross_entropy (liger on CUDA when installed) against F.cross_entropy of full logits: loss and grads."""
    from posfreq.train.model.loss import _liger_loss, liger_state, linear_cross_entropy, uses_liger

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
    done = f"{kernel} kernel, {str(dtype).removeprefix('torch.')}: loss {float(lean.detach()):.4f} and gradients equal full logits'"
    reason = liger_state()[1] if device.type == "cuda" else None
    if reason:  # correct but slow: a GPU-month must not start on it unnoticed
        raise AssertionError(f"{done}, but {reason}")
    return done


def string_hf_check(device: torch.device) -> str:
    """STRING through transformers with float32 weights under bf16 autocast (the probe's precision) against
    float32, and the attention backend it reaches (FlashAttention on a GPU)."""
    try:
        import transformers
    except ImportError:
        raise Skipped("transformers is not installed (the hf extra)") from None

    from posfreq.train.model import attention as attention_module
    from posfreq.train.positions.string_hf import apply_string

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
    )
    model = apply_string(transformers.LlamaForCausalLM(config)).eval().to(device)
    ids = torch.randint(3, 97, (2, 90), generator=torch.Generator().manual_seed(1)).to(device)
    chosen: list[str] = []
    resolve = attention_module.resolve_backend

    def recording(backend, dev, dtype, **call):
        name = resolve(backend, dev, dtype, **call)
        chosen.append(f"{name}/{str(dtype).removeprefix('torch.')}")
        return name

    attention_module.resolve_backend = recording
    try:
        with torch.no_grad():
            exact = model(input_ids=ids).logits.float()
            chosen.clear()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                mixed = model(input_ids=ids).logits.float()
    finally:
        attention_module.resolve_backend = resolve
    error = float((mixed - exact).abs().max() / exact.abs().max())
    if error > 0.05:
        raise AssertionError(
            f"bf16 autocast differs from float32 by {error:.3f} of the largest logit"
        )
    if device.type == "cuda" and not any(c.startswith(("varlen", "flash")) for c in chosen):
        raise AssertionError(
            f"STRING under bf16 autocast took {sorted(set(chosen))}, no FlashAttention"
        )
    return f"bf16 autocast vs float32: {error:.1e} of the largest logit; backends {sorted(set(chosen))}"
