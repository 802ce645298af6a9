"""Benchmark: STRING vs RoPE at inference, prefill time, prefill peak memory and per-token decode time.

For each context length L a small TinyLlama-architecture model is built with training length L
(so STRING uses its defaults S = L // 3, W = min(128, S // 2)) and fed one document of L tokens.
Goal: STRING within 1.15x of RoPE's time and 1.1x of its memory at the longest length.

- Prefill time: `hidden_states` over the whole document (no LM head, whose cost is the same
  for both). Each scheme is first warmed up once at the measured length (untimed), then timed
  --repeats times, the two schemes interleaved with their order alternating between repeats
  so machine noise and cache effects hit both; reported: the median, with the spread
  (min-max) of the repeats.
- Decode time: per token, over --decode-steps single-token steps on a KV cache holding L
  tokens; the same warm-up, alternation and median with spread. The cache is filled with random
  keys and values instead of a prefill (what it holds does not change the cost), so decoding
  can be measured at lengths whose prefill would take too long on a CPU (--prefill-max).
- Peak memory. CPU (Linux): per L, a fresh subprocess with glibc's mmap threshold at 64 KiB
  (so every sizeable tensor is mapped on allocation and unmapped when freed, and resident
  memory follows live tensors instead of the allocator's cache) resets the kernel's peak-RSS
  mark (/proc/self/clear_refs, "5") before each prefill and reports VmHWM minus VmRSS before
  the prefill: the extra memory one prefill needs at its peak, weights and inputs excluded.
  Both schemes are first run once at the measured length, so neither is measured cold.
  CUDA: max_memory_allocated above the allocated memory before the prefill.

CPU runs use --threads 1 by default: on a shared, oversubscribed machine multi-threaded
element-wise kernels are dominated by scheduling noise. Timings are wall-clock.

    python benchmarks/positions.py [--lengths 1024 2048 4096 8192 16384] [--device cpu|cuda]
    python benchmarks/positions.py --preset smollm-135m --lengths 8192 32768 --prefill-max 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from _timing import extra_peak_bytes, interleaved, median, spread
from tqdm import tqdm

from posfreq.train.model.config import model_preset
from posfreq.train.model.transformer import Transformer, uniform_cu_seqlens

SCHEMES = ("rope", "string")


def build(
    preset: str, length: int, device: str, dtype: torch.dtype
) -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    """A model with training length `length` and one random document of that length."""
    torch.manual_seed(0)
    model = (
        Transformer(model_preset(preset, vocab_size=512, train_len=length))
        .to(device=device, dtype=dtype)
        .eval()
    )
    tokens = torch.randint(0, 512, (length,), device=device)
    return model, tokens, uniform_cu_seqlens(1, length, device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def prefill_seconds(
    model: Transformer, tokens: torch.Tensor, cu: torch.Tensor, repeats: int, device: str
) -> dict[str, list[float]]:
    """Prefill wall times per scheme (see `interleaved`)."""

    def run(name: str) -> float:
        model.set_positions(name)
        sync(device)
        start = time.perf_counter()
        model.hidden_states(tokens, cu, tokens.numel())
        sync(device)
        return time.perf_counter() - start

    return interleaved(run, SCHEMES, repeats)


@torch.no_grad()
def decode_seconds(
    model: Transformer, tokens: torch.Tensor, steps: int, repeats: int, device: str
) -> dict[str, list[float]]:
    """Per-token decode times per scheme on a cache holding the whole document (see `interleaved`).

    The cache holds random keys and values (what it holds does not change the cost) and is rewound
    to the document's length before every timed run.
    """
    length = tokens.numel()
    caches = model.new_caches(
        1, length + steps, model.embed_tokens.weight.dtype, torch.device(device)
    )
    for cache in caches:
        cache.k.normal_()
        cache.v.normal_()
    one = uniform_cu_seqlens(1, 1, device)

    def run(name: str) -> float:
        model.set_positions(name)
        for cache in caches:
            cache.length = length
        sync(device)
        start = time.perf_counter()
        for step in range(steps):
            model.hidden_states(
                tokens[step : step + 1], one, 1, caches, position_offset=caches[0].length
            )
        sync(device)
        return (time.perf_counter() - start) / steps

    return interleaved(run, SCHEMES, repeats)


def cpu_peak_bytes(preset: str, length: int, threads: int) -> dict[str, int]:
    """Per scheme, the extra peak resident memory of one CPU prefill, measured in a fresh interpreter."""
    command = [
        sys.executable,
        __file__,
        "--child",
        "--lengths",
        str(length),
        "--preset",
        preset,
        "--threads",
        str(threads),
    ]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(
            f"memory subprocess failed (benchmarks/positions.py --child):\n{result.stderr[-2000:]}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


@torch.no_grad()
def child(preset: str, length: int) -> None:
    """Body of the memory subprocess: warm up both schemes at the measured length, then one measured prefill each."""
    model, tokens, cu = build(preset, length, "cpu", torch.float32)
    peaks = {}
    for name in SCHEMES:
        model.set_positions(name)
        model.hidden_states(tokens, cu, length)
    for name in SCHEMES:
        model.set_positions(name)
        peaks[name] = extra_peak_bytes(lambda: model.hidden_states(tokens, cu, length))
    print(json.dumps(peaks))


@torch.no_grad()
def cuda_peak_bytes(model: Transformer, tokens: torch.Tensor, cu: torch.Tensor, scheme: str) -> int:
    model.set_positions(scheme)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.hidden_states(tokens, cu, tokens.numel())
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def ratio(table: dict[str, list[float]] | None) -> float:
    """STRING's median over RoPE's; nan where the row was not measured."""
    return median(table["string"]) / median(table["rope"]) if table else float("nan")


def cells(table: dict[str, list[float]] | None, scale: float, digits: int) -> dict[str, str]:
    """Per scheme, 'median spread' scaled for printing, or '-' where the row was not measured."""
    if table is None:
        return {name: "-" for name in SCHEMES}
    return {name: f"{median(t) * scale:.{digits}f} {spread(t)}" for name, t in table.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument(
        "--preset", default="tiny-2l-128", help="model preset (train.model.config.PRESETS)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument(
        "--prefill-max",
        type=int,
        default=None,
        help="measure prefill time and memory only up to this length (decode at every length)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: least noise on a shared machine)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.preset, args.lengths[0])
        return
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    rows = []
    for length in tqdm(args.lengths, desc="lengths", file=sys.stderr):
        model, tokens, cu = build(args.preset, length, args.device, dtype)
        model.set_positions("string")
        options = model.positions.options
        prefill = memory = None
        if args.prefill_max is None or length <= args.prefill_max:
            prefill = prefill_seconds(model, tokens, cu, args.repeats, args.device)
            if args.device == "cuda":
                memory = {name: cuda_peak_bytes(model, tokens, cu, name) for name in SCHEMES}
            else:
                memory = cpu_peak_bytes(args.preset, length, args.threads)
        decode = decode_seconds(model, tokens, args.decode_steps, args.repeats, args.device)
        rows.append((length, options, prefill, memory, decode))
        del model

    print(
        f"\nSTRING vs RoPE, preset {args.preset}, {args.device}, {dtype}, threads {torch.get_num_threads()}; "
        f"times: median of {args.repeats} (spread min-max vs median), after a warm-up at each length"
    )
    print(
        f"{'L':>6} {'S':>5} {'W':>4} | {'prefill s rope':>21} {'string':>21} {'ratio':>6} | "
        f"{'peak MiB rope':>13} {'string':>8} {'ratio':>6} | {'decode ms rope':>21} {'string':>21} {'ratio':>6}"
    )
    for length, options, prefill, memory, decode in rows:
        pre, dec = cells(prefill, 1, 3), cells(decode, 1e3, 2)
        mem = {name: f"{memory[name] / 2**20:.1f}" if memory else "-" for name in SCHEMES}
        mem_ratio = (
            memory["string"] / memory["rope"] if memory and memory["rope"] > 0 else float("nan")
        )
        print(
            f"{length:>6} {options['shift']:>5} {options['window']:>4} | {pre['rope']:>21} {pre['string']:>21} "
            f"{ratio(prefill):>6.3f} | {mem['rope']:>13} {mem['string']:>8} {mem_ratio:>6.3f} | "
            f"{dec['rope']:>21} {dec['string']:>21} {ratio(decode):>6.3f}"
        )
    decoded = rows[-1]
    prefilled = [row for row in rows if row[2] is not None][-1:]
    if prefilled:
        length, _, prefill, memory, _ = prefilled[0]
        mem_ratio = memory["string"] / memory["rope"] if memory["rope"] > 0 else float("nan")
        print(
            f"\nlongest prefill, L = {length}: time {ratio(prefill):.3f}x (goal <= 1.15x), peak memory "
            f"{mem_ratio:.3f}x (goal <= 1.1x)"
        )
    print(f"longest decode, L = {decoded[0]}: {ratio(decoded[4]):.3f}x per token (goal <= 1.15x)")


if __name__ == "__main__":
    main()
