"""`make gpu-check`: everything CUDA this code base has, on one GPU, offline, in minutes, as one table and one JSON.

Stages, each with a time budget (a stage past it fails and the next one runs):

- ``environment``: GPU, driver, torch, CUDA, the kernels present, the installed `varlen_attn`'s signature,
  liger-kernel's state, and what ``auto`` picks;
- the doctor's single-GPU checks: ``pretrain-bf16`` (a tiny run with DCP checkpoints, stopped and continued by
  ``--resume auto``), ``attention-<backend>`` and ``probe-<backend>`` (rope, string, dca) against sdpa, and
  ``loss`` (liger against full logits);
- ``string-hf``: the doctor's check of STRING through transformers under bf16 autocast;
- ``varlen-native-gqa``: whether this torch's varlen kernel takes grouped key/value heads without copies;
- ``train-1.3b``: tinyllama-1.3b at L = 2048 through the real trainer (FSDP2, bf16, the pretraining config's
  micro-batch and activation checkpointing): tokens/s, and MFU against this GPU's own measured bf16 matmul
  rate as well as against its datasheet peak;
- ``block-compile``: one 1.3B block, forward and backward, eager against `torch.compile` (what fusing
  RMSNorm, rotary and SwiGLU would gain);
- ``string-prefill-32k``: STRING against RoPE prefill time at 32K tokens on SmolLM-135M's shape, through
  posfreq's own model and through transformers.

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
from typing import Callable

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


def train_stage(
    device: torch.device,
    work: Path,
    preset: str = "tinyllama-1.3b",
    length: int = 2048,
    steps: int = 7,
    warmup: int = 3,
    matmul_size: int = 8192,
    compile: str = "auto",
) -> dict:
    """`preset` at L = `length` through the trainer with the pretraining config's micro-batch and checkpointing."""
    import yaml

    from posfreq.train.model.fused import use_fused
    from posfreq.train.run.config import config_from_dict
    from posfreq.train.run.flops import measured_matmul_flops
    from posfreq.train.run.pretrain import train

    paper = yaml.safe_load(PRETRAIN_CONFIG.read_text())
    rows = paper["micro_batch_rows"]
    checkpointing = paper["model"].get("activation_checkpointing", False)
    data = work / "data"
    random_shards(data, 128_256, 128_001, documents=3000)
    config = {
        "out": str(work / "run"),
        "total_tokens": steps * 2 * rows * length,
        "global_batch_tokens": 2 * rows * length,  # two micro-batches: accumulation included
        "micro_batch_rows": rows,
        "accelerator": device.type,
        "devices": 1,
        "precision": "bf16-mixed",
        "model": {
            "preset": preset,
            "attention_backend": "auto",
            "activation_checkpointing": checkpointing,
            "compile": compile,
        },
        "data": {"dir": str(data), "train_len": length, "packing": paper["data"]["packing"]},
        "optim": {"warmup_steps": 2},
        "checkpoint": {
            "every_tokens": 10**15,
            "latest_every_steps": 0,
            "latest_every_minutes": 0,
            "milestone_weights_only": True,  # the end-of-run save: weights, not 16 GB of optimizer state
        },
        "logging": {"progress_bar": False},
    }
    measured = measured_matmul_flops(device, matmul_size, torch.bfloat16)
    try:
        history = train(config_from_dict(config))[warmup:]
    finally:
        use_fused(
            False
        )  # the trainer switched the process to fused kernels; the stages after compare eager
    flops = statistics.median(r["flops_per_s"] for r in history)
    row = history[
        0
    ]  # the trainer's MFU is against the datasheet peak: that peak is its flops / mfu
    datasheet = row["mfu"] and row["flops_per_s"] / row["mfu"]
    return {
        "detail": (
            f"{statistics.median(r['tokens_per_s'] for r in history):,.0f} tokens/s, "
            f"{flops / 1e12:.0f} TFLOP/s = {flops / measured:.1%} of the measured bf16 matmul "
            f"({measured / 1e12:.0f} TFLOP/s)"
            + (f", {flops / datasheet:.1%} of the datasheet peak" if datasheet else "")
            + f"; {rows} rows x {length} per micro-batch, activation checkpointing {checkpointing}, "
            f"model.compile {compile}"
            + (
                f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.0f} GiB"
                if device.type == "cuda"
                else ""
            )
        ),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in history),
        "flops_per_s": flops,
        "matmul_flops_per_s": measured,
        "mfu_measured": flops / measured,
        "mfu_datasheet": flops / datasheet if datasheet else None,
    }


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
    """STRING vs RoPE prefill at `length` on SmolLM-135M's shape: posfreq's model and transformers'."""
    import transformers

    from posfreq.train.model.config import model_preset
    from posfreq.train.model.transformer import Transformer, uniform_cu_seqlens
    from posfreq.train.positions.string_hf import STRING_ATTENTION, apply_string

    config = model_preset("smollm-135m")
    ours = Transformer(config).to(device, torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (length,), device=device)
    cu = uniform_cu_seqlens(1, length, device)
    times = {}
    with torch.inference_mode():
        for scheme in ("rope", "string"):
            ours.set_positions(scheme)
            times[f"posfreq {scheme}"] = _seconds(
                lambda: ours.hidden_states(ids, cu, length), device
            )
        # the same RoPE prefill on sdpa's kernel, which transformers uses: is `auto`'s varlen the faster one here?
        ours.set_positions("rope")
        ours.attention_backend = "sdpa"
        times["posfreq rope sdpa"] = _seconds(lambda: ours.hidden_states(ids, cu, length), device)
        ours.attention_backend = "auto"
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.d_model,
            intermediate_size=config.ffn_dim,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=config.n_kv_heads,
            max_position_embeddings=config.train_len,
            tie_word_embeddings=True,
        )
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
                return ours.hidden_states(ids, cu, length)

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
    ours_ratio = times["posfreq string"] / times["posfreq rope"]
    hf_ratio = times[f"transformers {STRING_ATTENTION}"] / times["transformers sdpa"]
    return (
        f"L = {length}: posfreq rope {times['posfreq rope'] * 1e3:.0f} ms, string "
        f"{times['posfreq string'] * 1e3:.0f} ms ({ours_ratio:.2f}x), rope on sdpa "
        f"{times['posfreq rope sdpa'] * 1e3:.0f} ms; transformers sdpa "
        f"{times['transformers sdpa'] * 1e3:.0f} ms, STRING {times[f'transformers {STRING_ATTENTION}'] * 1e3:.0f} ms "
        f"({hf_ratio:.2f}x); goal <= 1.15x"
    )


def stages(device: torch.device, out: Path) -> list[tuple[str, float, Callable[[], str]]]:
    """(name, budget in seconds, body) in order; probe stages use the pretraining stage's checkpoint."""
    from posfreq.train.checkpoint import layout as ckpt
    from posfreq.train.preflight.pretrain_check import pretrain_check, write_tiny_corpus

    made: dict[str, object] = {}

    def pretrain() -> str:
        _gpu_only(device)
        data = write_tiny_corpus(out / "data")
        detail = pretrain_check(out / "pretrain-bf16", data, device, "bf16-mixed", 1)
        run = ckpt.checkpoint_root(out / "pretrain-bf16" / "uninterrupted")
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
    # The most telling first, so that a run cut short still answers them.
    return [
        ("environment", 60, lambda: environment_stage(device)),
        *[(f"attention-{b}", 90, lambda b=b: attention_check(b, device)) for b in backends],
        ("loss", 60, lambda: loss_check(device)),
        ("string-hf", 60, lambda: string_hf_check(device)),
        ("varlen-native-gqa", 30, lambda: varlen_gqa_stage(device)),
        ("train-1.3b", 240, lambda: train("auto")),
        (
            "string-prefill-32k",
            120,
            lambda: _gpu_only(device) or prefill_stage(device, profile=out / "string_profile.txt"),
        ),
        ("train-1.3b-eager", 180, lambda: train("off")),
        ("pretrain-bf16", 240, pretrain),
        *[(f"probe-{b}", 60, lambda b=b: probe(b)) for b in backends],
        ("block-compile", 150, lambda: _gpu_only(device) or block_compile_stage(device)),
    ]


def run_stages(
    device: torch.device, out: Path, report: Path, only: set[str] | None
) -> list[CheckResult]:
    """Run every stage (or those in `only`), printing each row as it ends and rewriting `report` after each."""
    from posfreq.train.preflight.doctor import format_table

    results: list[CheckResult] = []
    started = time.perf_counter()
    for name, budget, body in stages(device, out):
        if only and name not in only:
            continue

        bounded = functools.partial(within_budget, body, budget)
        results.append(run_check(name, bounded, device, children=name == "pretrain-bf16"))
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
        out = claim_work_dir(args.out, "gpu-check", ("data", "pretrain-bf16", "train-1.3b"))
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
