"""Benchmark: every position scheme through transformers (train/positions/hf_schemes.py) vs posfreq's own engine on
the same Llama weights, as the probe runs them: a batch of prompts of L - B tokens and B greedy new tokens.

Each engine is the probe's own Generator: posfreq's Transformer (`set_positions`) and the transformers engine's
TransformersGenerator over a LlamaForCausalLM (`apply_scheme`). One untimed warm-up per (scheme, engine), then
--repeats interleaved rounds; printed per scheme as tests/s of each engine and their ratio (goal: transformers
>= 0.9x posfreq's).

    python benchmarks/hf_schemes.py [--length 2048] [--batch 4] [--new-tokens 18] [--repeats 3] [--threads 2]
    python benchmarks/hf_schemes.py --length 512 --repeats 1 --layers 2   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import time

import torch
from _timing import interleaved, median, spread
from transformers import LlamaConfig, LlamaForCausalLM

from posfreq.analysis.niah.hf_engine import TransformersGenerator
from posfreq.train.model.hf import load_hf_model
from posfreq.train.positions.hf_schemes import apply_scheme
from posfreq.train.positions.schemes import SCHEMES


def build(length: int, layers: int, directory: str) -> tuple[LlamaForCausalLM, object]:
    """SmolLM-135M's width with `layers` layers and random weights (max_position_embeddings = length), as a
    transformers model and imported into posfreq's model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=length,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    hf = LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    return hf, load_hf_model(directory).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--length", type=int, default=2048, help="L: test length and training length"
    )
    parser.add_argument("--batch", type=int, default=4, help="tests decoded together")
    parser.add_argument("--new-tokens", type=int, default=18, help="B: greedy tokens per test")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (SmolLM-135M: 30)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        hf, ours = build(args.length, args.layers, directory)
        generator = TransformersGenerator(hf)
        prompt = torch.randint(0, 49152, (args.batch, args.length - args.new_tokens))
        print(
            f"probe workload: {args.batch} tests of {args.length - args.new_tokens} prompt + {args.new_tokens} new "
            f"tokens, SmolLM-135M's width, {args.layers} layers, float32, {args.threads} threads; "
            f"median of {args.repeats} (spread)"
        )
        for scheme in args.schemes.split(","):
            ours.set_positions(scheme)
            apply_scheme(hf, scheme)

            @torch.no_grad()
            def run(engine: str) -> float:
                model = ours if engine == "posfreq" else generator
                start = time.perf_counter()
                model.generate(prompt, args.new_tokens)
                return time.perf_counter() - start

            times = interleaved(run, ("posfreq", "transformers"), args.repeats)
            rate = {e: args.batch / median(t) for e, t in times.items()}
            print(
                f"{scheme:12s} posfreq {rate['posfreq']:.2f} tests/s {spread(times['posfreq'])}, transformers "
                f"{rate['transformers']:.2f} tests/s {spread(times['transformers'])}: "
                f"{rate['transformers'] / rate['posfreq']:.2f}x (goal >= 0.9x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
