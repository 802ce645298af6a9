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
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from posfreq.train.atomic import write_json_atomic, write_text_atomic
from posfreq.train.devices import nvidia_driver
from posfreq.train.model import attention_kernels
from posfreq.train.preflight.checks import (
    CheckResult,
    Skipped,
    _cu,
    attention_check,
    environment,
    loss_check,
    probe_check,
    run_check,
    string_hf_check,
)

PRETRAIN_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pretrain_2k.yaml"


def _gpu_only(device: torch.device) -> None:
    if device.type != "cuda":
        raise Skipped("no CUDA GPU here")


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
    _gpu_only(device)
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
        native_s = _seconds(lambda: attend(q, k, v, cu, length, False), device)
        repeat_s = _seconds(lambda: attend(q, k, v, cu, length, True), device)
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


def random_shards(directory: Path, vocab: int, eos: int, documents: int) -> None:
    """Random documents of 16 to 4,000 tokens (log-uniform), one token shard."""
    from posfreq.train.data.shards import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(
        directory, "random", tokenizer="llama3", vocab_size=vocab, eos_id=eos
    ) as writer:
        for _ in range(documents):
            n = int(np.exp(rng.uniform(np.log(16), np.log(4000))))
            writer.add(np.append(rng.integers(0, eos, n), eos))


USR1_MARGIN_SECONDS = 300
"""slurm/pretrain_*.sh's `--signal=USR1@300`: a step and the save it triggers must end within it."""


@contextlib.contextmanager
def _timed(owner: type, method: str, into: list[float]) -> Iterator[None]:
    """Record the wall seconds of each call of `owner.method` (synchronized on CUDA) into `into`, for the block."""
    original = getattr(owner, method)

    def timed(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            into.append(time.perf_counter() - started)

    setattr(owner, method, timed)
    try:
        yield
    finally:
        setattr(owner, method, original)


def train_stage(
    device: torch.device,
    work: Path,
    preset: str = "tinyllama-1.3b",
    length: int = 2048,
    micro_batches: int = 16,
    steps: int = 4,
    save_at: int = 2,
    matmul_size: int = 8192,
    compile: str = "auto",
    vocab: int = 128_256,
) -> dict:
    """`preset` at L = `length` through one rank's real accumulation loop (the pretraining config's micro-batch and
    checkpointing, `micro_batches` of them per step, as on 16 GPUs): `save_at` steps, then the sharded resumable
    save a stop makes (model and optimizer), then a resume to `steps`. Step time, MFU against the datasheet peak
    and the measured bf16 matmul rate, peak memory, and save and load times against the USR1 margin. The data's `vocab` (Llama-3's by default) sizes the model's."""
    import yaml

    from posfreq.train.model.fused import resolve_compile, use_fused
    from posfreq.train.run.config import config_from_dict
    from posfreq.train.run.flops import measured_matmul_flops
    from posfreq.train.run.pretrain import train
    from posfreq.train.run.trainer import Trainer

    paper = yaml.safe_load(PRETRAIN_CONFIG.read_text())
    rows = paper["micro_batch_rows"]
    checkpointing = paper["model"].get("activation_checkpointing", False)
    data = work / "data"
    random_shards(
        data, vocab, vocab - 255, documents=micro_batches * rows * 3
    )  # Llama-3's EOS: 128,001
    step_tokens = micro_batches * rows * length
    config = {
        "out": str(work / "run"),
        "total_tokens": steps * step_tokens,
        "global_batch_tokens": step_tokens,
        "micro_batch_rows": rows,
        "accelerator": device.type,
        "devices": 1,
        "precision": "bf16-mixed",
        "resume": "auto",
        "model": {
            "preset": preset,
            "attention_backend": "auto",
            "activation_checkpointing": checkpointing,
            "compile": compile,
        },
        "data": {"dir": str(data), "train_len": length, "packing": paper["data"]["packing"]},
        "optim": {"warmup_steps": 1},
        "checkpoint": {
            "every_tokens": 10**15,
            "latest_every_steps": 0,
            "latest_every_minutes": 0,
            "milestone_weights_only": True,  # the end-of-run save: weights only
        },
        "logging": {"progress_bar": False},
    }
    measured = measured_matmul_flops(device, matmul_size, torch.bfloat16)
    saves: list[float] = []
    loads: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with _timed(Trainer, "save", saves), _timed(Trainer, "_load", loads):
            first = train(config_from_dict({**config, "stop_at_step": save_at}))
            resumed = train(config_from_dict(config))
    finally:
        use_fused(
            False
        )  # the trainer switched the process to fused kernels; the stages after compare eager
    if len(first) != save_at or len(resumed) != steps - save_at or not loads:
        raise AssertionError(
            f"expected {save_at} steps, a save, a load and {steps - save_at} more; got {len(first)} steps, "
            f"{len(saves)} saves, {len(loads)} loads and {len(resumed)} steps"
        )
    timed = first[1:] + resumed[1:]  # each process's first step compiles
    step_s = statistics.median(r["step_time_s"] for r in timed)
    flops = statistics.median(r["flops_per_s"] for r in timed)
    row = timed[0]  # the trainer's MFU is against the datasheet peak: that peak is its flops / mfu
    datasheet = row["mfu"] and row["flops_per_s"] / row["mfu"]
    save_s, load_s = saves[0], loads[0]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    planned = _planned_gib(config_from_dict(config), vocab, resolve_compile(compile, device.type))
    if step_s + save_s > USR1_MARGIN_SECONDS:
        raise AssertionError(
            f"a step ({step_s:.0f} s) and the save it triggers ({save_s:.0f} s) take longer than the "
            f"{USR1_MARGIN_SECONDS} s between SLURM's USR1 and the time limit"
        )
    return {
        "detail": (
            f"{micro_batches} x {rows} rows x {length} per step: {step_s:.2f} s/step, "
            f"{statistics.median(r['tokens_per_s'] for r in timed):,.0f} tokens/s, "
            + (f"MFU {flops / datasheet:.1%} of the datasheet peak, " if datasheet else "")
            + f"{flops / measured:.1%} of the measured bf16 matmul ({measured / 1e12:.0f} TFLOP/s, "
            f"{flops / 1e12:.0f} TFLOP/s here)"
            + (f"; peak {peak:.1f} GiB" if peak is not None else "")
            + f" (posfreq plan: {planned:.1f} GiB)"
            + f"; sharded save {save_s:.1f} s, load {load_s:.1f} s (step + save within the "
            f"{USR1_MARGIN_SECONDS} s USR1 margin); activation checkpointing {checkpointing}, "
            f"model.compile {compile}"
        ),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_s": step_s,
        "flops_per_s": flops,
        "matmul_flops_per_s": measured,
        "mfu_measured": flops / measured,
        "mfu_datasheet": flops / datasheet if datasheet else None,
        "save_s": save_s,
        "load_s": load_s,
        "peak_gib": peak,
        "planned_gib": planned,
    }


def _planned_gib(cfg, vocab: int, compiled: bool) -> float:
    """train/run/memory.py's figure for one rank of this stage's run, to set beside the measured peak."""
    from posfreq.train.run.geometry import resolve_model_config
    from posfreq.train.run.memory import GIB, configured, meta_model

    return configured(meta_model(resolve_model_config(cfg, vocab)), cfg, 1, compiled).total / GIB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(call: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of `call` after one warm-up, synchronized."""
    call()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
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

    eager = _seconds(step(block), device)
    started = time.perf_counter()
    compiled = torch.compile(block)
    try:
        fused = _seconds(step(compiled), device)
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
    _sync(device)
    with profile(activities=activities) as prof:
        call()
        _sync(device)
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
            times[f"posfreq {scheme}"] = _seconds(prefill, device)
        # the same RoPE prefill on sdpa's kernel, which transformers uses: is `auto`'s varlen the faster one here?
        ours.set_positions("rope")
        ours.attention_backend = "sdpa"
        times["posfreq rope sdpa"] = _seconds(prefill, device)
        ours.attention_backend = "auto"
    # the same model as transformers builds it from our export's config (rope_theta, norm eps, head_dim included)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**config_to_hf(config, torch.bfloat16, None, None))
    )
    hf = apply_string(hf).to(device, torch.bfloat16).eval()
    with torch.inference_mode():
        for name in ("sdpa", STRING_ATTENTION):
            hf.set_attn_implementation(name)
            times[f"transformers {name}"] = _seconds(
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
        _gpu_only(device)
        data = write_tiny_corpus(out / "data") if not (out / "data").is_dir() else out / "data"
        detail = check(out / name, data)
        run = ckpt.checkpoint_root(out / name / "uninterrupted")
        made["checkpoint"] = max(run.glob(f"{ckpt.MILESTONE_PREFIX}*"))
        return detail

    def probe(backend: str) -> str:
        _gpu_only(device)
        return probe_check(made.get("checkpoint"), backend, device)

    def train(compile: str) -> str:
        _gpu_only(device)
        shutil.rmtree(out / "train-1.3b", ignore_errors=True)
        result = train_stage(device, out / "train-1.3b", compile=compile)
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
            lambda: _gpu_only(device) or varlen_repeatability_stage(device),
            True,
        ),
        ("train-1.3b", 240, lambda: train("auto"), True),
        (
            "string-prefill-32k",
            60,
            lambda: _gpu_only(device) or prefill_stage(device, profile=out / "string_profile.txt"),
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
        ("block-compile", 150, lambda: _gpu_only(device) or block_compile_stage(device), False),
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
