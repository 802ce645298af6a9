"""Benchmark: STRING through transformers (attn_implementation "posfreq_string") vs transformers' own sdpa
attention on the same weights: prefill time and peak memory at L, and time per decoded token on a cache of L.

The model is a random-weight Llama of SmolLM-135M's shape (30 layers, d 576, 9 heads, 3 KV heads) with
max_position_embeddings = L, so STRING uses S = L // 3 and W = min(128, S // 2). Prefill runs the decoder
(`model.model`, no LM head, whose cost is the same for both); decoding feeds --decode-steps single
tokens on a DynamicCache holding L tokens, cropped back to L before every timed run. Times: one untimed
warm-up per implementation at the measured length, then --repeats interleaved rounds with alternating
order, median and spread. Peak memory (CPU, Linux): a fresh process per run (see `extra_peak_bytes`).
Goal: STRING within 1.15x of sdpa's time and 1.05x of its peak memory.

    python benchmarks/string_hf.py [--length 8192] [--repeats 3] [--decode-steps 8] [--threads 2]
    python benchmarks/string_hf.py --length 512 --repeats 1 --decode-steps 2   # a quick check that it runs
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
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from posfreq.analysis.niah.hf_engine import cache_keyword
from posfreq.train.positions.string_hf import STRING_ATTENTION, settings_of

IMPLEMENTATIONS = ("sdpa", STRING_ATTENTION)


def build(length: int) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """SmolLM-135M's shape with random weights, max_position_embeddings = length, and one random prompt."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=length,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    return model, torch.randint(0, config.vocab_size, (1, length))


@torch.no_grad()
def prefill_seconds(model: LlamaForCausalLM, ids: torch.Tensor, repeats: int) -> dict:
    def run(name: str) -> float:
        model.set_attn_implementation(name)
        start = time.perf_counter()
        model.model(input_ids=ids, use_cache=False)
        return time.perf_counter() - start

    return interleaved(run, IMPLEMENTATIONS, repeats)


@torch.no_grad()
def decode_seconds(model: LlamaForCausalLM, ids: torch.Tensor, steps: int, repeats: int) -> dict:
    """Per-token decode time on a cache of the whole prompt (filled once by an sdpa prefill)."""
    length = ids.shape[1]
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    keyword = cache_keyword(model.model)
    model.model(input_ids=ids, use_cache=True, **{keyword: cache})
    new = torch.randint(0, model.config.vocab_size, (1, steps))

    def run(name: str) -> float:
        model.set_attn_implementation(name)
        extra = cache.get_seq_length() - length
        if extra:
            cache.crop(-extra)  # back to the prompt: transformers 5 crops by a negative count
        start = time.perf_counter()
        for step in range(steps):
            position = torch.tensor([[length + step]])
            model.model(
                input_ids=new[:, step : step + 1],
                **{keyword: cache},
                use_cache=True,
                position_ids=position,
                cache_position=position[0],
            )
        return (time.perf_counter() - start) / steps

    return interleaved(run, IMPLEMENTATIONS, repeats)


def peak_bytes(length: int, threads: int) -> dict[str, int]:
    """Per implementation, the extra peak resident memory of one prefill, each in a fresh process."""
    peaks = {}
    for name in IMPLEMENTATIONS:
        command = [sys.executable, __file__, "--child", name, "--length", str(length)]
        command += ["--threads", str(threads)]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode:
            raise RuntimeError(f"memory subprocess failed:\n{result.stderr[-2000:]}")
        peaks[name] = json.loads(result.stdout.strip().splitlines()[-1])
    return peaks


@torch.no_grad()
def child(name: str, length: int) -> None:
    """Body of a memory process: one warm-up prefill, then one measured."""
    model, ids = build(length)
    model.set_attn_implementation(name)
    model.model(input_ids=ids, use_cache=False)
    print(json.dumps(extra_peak_bytes(lambda: model.model(input_ids=ids, use_cache=False))))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child, args.length)
        return
    model, ids = build(args.length)
    settings = settings_of(model.config)
    prefill = prefill_seconds(model, ids, args.repeats)
    decode = decode_seconds(model, ids, args.decode_steps, args.repeats)
    memory = peak_bytes(args.length, args.threads) if sys.platform == "linux" else None
    sdpa, string = IMPLEMENTATIONS
    print(
        f"STRING (S = {settings.shift}, W = {settings.window}) vs sdpa through transformers, L = "
        f"{args.length}, SmolLM-135M's shape, float32, {torch.get_num_threads()} threads; median of "
        f"{args.repeats} (spread)"
    )
    print(
        f"prefill: sdpa {median(prefill[sdpa]):.2f} s {spread(prefill[sdpa])}, string "
        f"{median(prefill[string]):.2f} s {spread(prefill[string])}: "
        f"{median(prefill[string]) / median(prefill[sdpa]):.3f}x time (goal <= 1.15x)"
    )
    if memory:
        print(
            f"prefill peak memory: sdpa {memory[sdpa] / 2**20:.0f} MiB, string "
            f"{memory[string] / 2**20:.0f} MiB: {memory[string] / memory[sdpa]:.3f}x (goal <= 1.05x)"
        )
    print(
        f"decode per token: sdpa {median(decode[sdpa]) * 1e3:.1f} ms {spread(decode[sdpa])}, string "
        f"{median(decode[string]) * 1e3:.1f} ms {spread(decode[string])}: "
        f"{median(decode[string]) / median(decode[sdpa]):.3f}x time (goal <= 1.15x)"
    )


if __name__ == "__main__":
    main()
