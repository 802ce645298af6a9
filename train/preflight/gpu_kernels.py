"""`make gpu-check`'s kernel stages (train/preflight/gpu_check.py runs them): the environment, whether the varlen
kernel takes grouped heads and repeats its backward bitwise, one block eager against compiled, and STRING's 32K
prefill against the fastest RoPE path, with a kernel profile of each."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from posfreq.train.atomic import write_text_atomic
from posfreq.train.devices import nvidia_driver
from posfreq.train.model import attention_kernels
from posfreq.train.preflight.checks import Skipped, _cu, environment


def gpu_only(device: torch.device) -> None:
    """Skip the stage (Skipped) where `device` is not a CUDA GPU."""
    if device.type != "cuda":
        raise Skipped("no CUDA GPU here")


def environment_stage(device: torch.device) -> str:
    """The doctor's environment line, plus the driver, the varlen signature and liger's state."""
    from posfreq.train.model.loss import liger_state

    parts = [environment(device)]
    driver = nvidia_driver()
    parts.append(f"driver {driver[0] if driver else 'unknown (no nvidia-smi)'}")
    try:
        import inspect

        from torch.nn.attention import varlen

        api = attention_kernels.varlen_api()
        params = ", ".join(inspect.signature(varlen.varlen_attn).parameters)
        parts.append(f"varlen_attn({params}) -> {api}")
    except ImportError:
        parts.append("no torch.nn.attention.varlen (torch < 2.10)")
    reason = liger_state()[1]
    parts.append(f"liger: {reason or 'ok'}")
    if (
        device.type == "cuda"
    ):  # which GPUs this wheel has kernels for: an A100 needs sm_80, an H100 sm_90
        parts.append(f"wheel built for {' '.join(torch.cuda.get_arch_list())}")
    return "; ".join(parts)


def varlen_gqa_stage(device: torch.device) -> str:
    """Whether the installed varlen kernel takes fewer key/value heads than query heads as they are: forward,
    log-sum-exp and backward against repeated heads, and the time of each way on one 32K sequence."""
    gpu_only(device)
    from torch.nn.attention import varlen

    api = attention_kernels.varlen_api()
    causal = {"window_size": (-1, 0)} if api.causal == "window_size" else {"is_causal": True}
    if (
        api.gqa
    ):  # torch >= 2.12 guards grouped heads behind this flag (harmless on equal head counts)
        causal["enable_gqa"] = True
    lse = {"return_aux": varlen.AuxRequest(lse=True)}

    def attend(q, k, v, cu, longest, repeat: bool, **extra):
        if repeat:
            k, v = (
                k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                v.repeat_interleave(q.shape[1] // v.shape[1], 1),
            )
        return varlen.varlen_attn(q, k, v, cu, cu, longest, longest, **causal, **extra)

    lens = [300, 17, 555]
    cu = _cu(lens, device)
    q, k, v = (
        torch.randn(sum(lens), h, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        for h in (32, 4, 4)
    )
    try:
        native, native_lse = attend(q, k, v, cu, 555, False, **lse)
        native.float().square().sum().backward()
    except Exception as err:  # the answer is the finding
        return f"no: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference, reference_lse = attend(q, k, v, cu, 555, True, **lse)
    reference.float().square().sum().backward()
    diffs = {
        "out": float((native - reference).detach().float().abs().max()),
        "lse": float((native_lse - reference_lse).detach().float().abs().max()),
        **{
            f"d{n}": float((g - t.grad).float().abs().max())
            for n, g, t in zip("qkv", grads, (q, k, v))
        },
    }
    # One SmolLM-135M-shaped layer at 32K (9 query heads over 3 key/value heads), inference.
    length = 32_768
    cu = _cu([length], device)
    with torch.inference_mode():
        q, k, v = (
            torch.randn(length, h, 64, device=device, dtype=torch.bfloat16) for h in (9, 3, 3)
        )
        native_s = median_seconds(lambda: attend(q, k, v, cu, length, False), device)
        repeat_s = median_seconds(lambda: attend(q, k, v, cu, length, True), device)
    return (
        f"yes{' (with enable_gqa)' if api.gqa else ' without enable_gqa'}; max difference to repeated heads "
        + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items())
        + f"; 32K prefill layer: native {native_s * 1e3:.2f} ms, repeated {repeat_s * 1e3:.2f} ms"
    )


def varlen_repeatability_stage(
    device: torch.device, rows: int = 8, length: int = 2048, backend: str = "auto"
) -> str:
    """Whether per-document attention's backward (`backend`, as training runs it: 32 query and 4 key/value heads
    of 64) is bitwise repeatable on `rows` x `length` packed tokens of ragged documents: the same inputs twice, the
    same gradients? A kernel that accumulates with atomics is not, and then resumed runs match uninterrupted ones
    only to a tolerance."""
    from posfreq.train.model.attention import varlen_attention

    generator = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    for _ in range(rows):  # each row cut into documents of 16 to 2,048 tokens
        left = length
        while left:
            n = min(left, int(torch.randint(16, length + 1, (1,), generator=generator)))
            lengths.append(n)
            left -= n
    cu = _cu(lengths, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (
        torch.randn(rows * length, h, 64, generator=generator).to(device, dtype).requires_grad_()
        for h in (32, 4, 4)
    )
    weight = torch.randn(rows * length, 32, 64, generator=generator).to(device, dtype)

    def gradients() -> list[torch.Tensor]:
        for x in (q, k, v):
            x.grad = None
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend=backend)
        (out * weight).float().sum().backward()
        return [x.grad.clone() for x in (q, k, v)]

    first, second = gradients(), gradients()
    differ = {n: int((a != b).sum()) for n, a, b in zip("qkv", first, second)}
    total = sum(x.numel() for x in first)
    name = attention_kernels.resolve_backend(backend, device, dtype, backward=True)
    if not any(differ.values()):
        return f"{name}: bitwise repeatable ({len(lengths)} documents in {rows} x {length} tokens)"
    return (
        f"{name}: NOT bitwise repeatable: {sum(differ.values()):,} of {total:,} gradient values differ between "
        f"two identical backwards (dq {differ['q']:,}, dk {differ['k']:,}, dv {differ['v']:,}); resumed runs "
        "match uninterrupted ones to a tolerance, not exactly"
    )


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(call: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of `call` after one warm-up, synchronized."""
    call()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_compile_stage(
    device: torch.device, preset: str = "tinyllama-1.3b", rows: int = 8, length: int = 2048
) -> str:
    """One block at rows x length packed tokens, forward and backward in bf16: eager vs torch.compile."""
    from dataclasses import replace

    from posfreq.train.model.config import model_preset
    from posfreq.train.model.transformer import Block, Transformer, uniform_cu_seqlens

    config = model_preset(preset)
    block = Block(config).to(device, torch.bfloat16)
    context = Transformer(replace(config, n_layers=1, vocab_size=8)).to(device)
    tokens = rows * length
    ctx = context._context(uniform_cu_seqlens(rows, length, device), length, tokens)
    x = torch.randn(tokens, config.d_model, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(fn):
        return lambda: fn(x, ctx).float().pow(2).mean().backward()

    eager = median_seconds(step(block), device)
    started = time.perf_counter()
    compiled = torch.compile(block)
    try:
        fused = median_seconds(step(compiled), device)
    except Exception as err:  # the finding is whether it compiles
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"eager {eager * 1e3:.1f} ms; torch.compile failed: {type(err).__name__}: {first}"
    return (
        f"{preset} block, {tokens} tokens: eager {eager * 1e3:.1f} ms, compiled {fused * 1e3:.1f} ms "
        f"per forward+backward ({eager / fused:.2f}x; compile {time.perf_counter() - started:.0f} s)"
    )


def kernel_profile(
    call: Callable[[], object], device: torch.device, title: str, top: int = 12
) -> str:
    """The `top` operators of one call by device time (self), and the host-device copies and syncs it made."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    call()
    sync(device)
    with profile(activities=activities) as prof:
        call()
        sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60)
    syncs = [
        e
        for e in prof.key_averages()
        if any(
            w in e.key
            for w in (
                "cudaStreamSynchronize",
                "cudaMemcpy",
                "cudaDeviceSynchronize",
                "item",
                "_local_scalar_dense",
            )
        )
    ]
    counts = ", ".join(f"{e.key} x{e.count}" for e in syncs) or "none"
    return f"== {title}\nhost syncs and copies: {counts}\n{table}\n"


def prefill_stage(device: torch.device, length: int = 32_768, profile: Path | None = None) -> str:
    """STRING vs the fastest RoPE prefill at `length` on SmolLM-135M's shape (posfreq's model on each attention
    path, and transformers'), each call with fresh cu_seqlens, as a real batch brings: the goal is STRING within
    1.10x of whichever RoPE path is fastest on this GPU, not of posfreq's own RoPE."""
    import transformers

    from posfreq.train.model.config import model_preset
    from posfreq.train.model.hf import config_to_hf
    from posfreq.train.model.transformer import Transformer, uniform_cu_seqlens
    from posfreq.train.positions.string_hf import STRING_ATTENTION, apply_string

    config = model_preset("smollm-135m")
    ours = Transformer(config).to(device, torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (length,), device=device)

    def prefill() -> object:  # fresh cu_seqlens each call: no kernel may reuse the last call's
        return ours.hidden_states(ids, uniform_cu_seqlens(1, length, device), length)

    times = {}
    with torch.inference_mode():
        for scheme in ("rope", "string"):
            ours.set_positions(scheme)
            times[f"posfreq {scheme}"] = median_seconds(prefill, device)
        # the same RoPE prefill on sdpa's kernel, which transformers uses: is `auto`'s varlen the faster one here?
        ours.set_positions("rope")
        ours.attention_backend = "sdpa"
        times["posfreq rope sdpa"] = median_seconds(prefill, device)
        ours.attention_backend = "auto"
    # the same model as transformers builds it from our export's config (rope_theta, norm eps, head_dim included)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**config_to_hf(config, torch.bfloat16, None, None))
    )
    hf = apply_string(hf).to(device, torch.bfloat16).eval()
    with torch.inference_mode():
        for name in ("sdpa", STRING_ATTENTION):
            hf.set_attn_implementation(name)
            times[f"transformers {name}"] = median_seconds(
                lambda: hf.model(input_ids=ids[None], use_cache=False), device
            )
    if profile is not None:

        def posfreq_call(scheme: str, backend: str) -> Callable[[], object]:
            def call() -> object:
                ours.set_positions(scheme)
                ours.attention_backend = backend
                return prefill()

            return call

        def transformers_call(attention: str) -> Callable[[], object]:
            return lambda: (
                hf.set_attn_implementation(attention)
                or hf.model(input_ids=ids[None], use_cache=False)
            )

        # the RoPE rows on sdpa name the kernel sdpa picks on this GPU (flash, cuDNN, efficient)
        calls = {
            "posfreq string": posfreq_call("string", "auto"),
            "posfreq rope": posfreq_call("rope", "auto"),
            "posfreq rope on sdpa": posfreq_call("rope", "sdpa"),
            "transformers sdpa": transformers_call("sdpa"),
            "transformers STRING": transformers_call(STRING_ATTENTION),
        }
        with torch.inference_mode():
            write_text_atomic(
                profile,
                "".join(kernel_profile(call, device, title) for title, call in calls.items()),
            )
        ours.attention_backend = "auto"
    rope_paths = ("posfreq rope", "posfreq rope sdpa", "transformers sdpa")
    fastest = min(rope_paths, key=times.__getitem__)
    ms = {name: f"{seconds * 1e3:.0f} ms" for name, seconds in times.items()}
    ours_ratio = times["posfreq string"] / times[fastest]
    hf_ratio = times[f"transformers {STRING_ATTENTION}"] / times[fastest]
    return (
        f"L = {length}: posfreq rope {ms['posfreq rope']}, rope on sdpa {ms['posfreq rope sdpa']}, string "
        f"{ms['posfreq string']}; transformers sdpa {ms['transformers sdpa']}, STRING "
        f"{ms[f'transformers {STRING_ATTENTION}']}; fastest RoPE: {fastest}; posfreq string {ours_ratio:.2f}x it, "
        f"transformers STRING {hf_ratio:.2f}x it (goal <= 1.10x)"
    )
