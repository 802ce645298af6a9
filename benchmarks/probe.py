"""NIAH probe decoding throughput on a SmolLM-135M-shaped model, side by side with its alternatives.

For each test length (default 1,024 and 4,096 tokens: a prompt of length - max_new_tokens plus
the answer budget), on the same seeded tests, it times every row below `--repeats` times (default 3),
the rows interleaved with their order alternating between rounds, and prints each row's median
tests/s with the spread of the repeats, and ratios of medians:

1. the probe's greedy decoding (`analysis.niah.decoding.generate_answers`, KV cache, prompts forwarded in
   groups of at most CPU_PREFILL_TOKENS tokens as `--prefill-tokens auto` does on a CPU) at batch 1
   and at `--batch-size` (default 8), and at `--batch-size` with the whole batch forwarded at once;
   the generated token ids must be equal (asserted); at batch 1 under `--precision bfloat16` (CPU
   autocast of everything), and at both batch sizes under `--precision bfloat16-prefill` (the
   prompt's forward in bf16, the cache and the decoding steps in float32); the token ids agreeing
   with float32 are counted, not asserted: bf16 rounding changes near-ties;
2. the teacher-forced score (`analysis.niah.decoding.teacher_forced`, one forward pass per batch) vs greedy
   decoding, as time per test at `--batch-size`;
3. Hugging Face `transformers` (`LlamaForCausalLM.generate`, greedy, float32) on the same weights
   (exported with `train.model.hf.export_hf`), the same prompts and the same max_new_tokens, at batch 1
   and at `--batch-size`: the probe's tests/s over transformers'. The first 2 tests' greedy token ids
   must equal the probe's (asserted); the agreement on all tests is printed.

The model is SmolLM-135M's shape (30 layers, d_model 576, 9 heads, 3 KV heads, FFN 1,536,
vocabulary 49,152, tied embeddings: 134.5M parameters) with random weights (seed 0), saved as a
consolidated checkpoint and loaded with the probe's own loader (`checkpoint_source(...).load`).
Prompts are Llama-3 tokenizations of the probe's NIAH tests, so a length in tokens holds as much
text as with a real Llama-3-style BPE, with every id taken modulo 49,152 (a registered tokenizer,
`llama3-mod49152`): about 3% of the pg haystack's tokens (rare words) have Llama-3 ids beyond the
model's vocabulary and become other ids. Throughput depends on how many tokens a prompt holds, not
on which; the `bytes` tokenizer would fit the vocabulary too, but its 35-token reference answer
does not fit a 32-token budget (Llama-3's takes 16). A random model never writes EOS or the four
needles, so every test decodes the full `--max-new-tokens` (default 32, about a real 4-number
answer; each length's line prints the mean generated). CPU, float32, torch's default thread count.
The default run is long on 2 cores (one 4K test is about 1.5 TFLOP, decoded 9 times per round);
`--lengths 1024` alone takes a fraction of it.

    python benchmarks/probe.py [--lengths 1024,4096] [--tests 8] [--batch-size 8] [--max-new-tokens 32] [--repeats 3]
    python benchmarks/probe.py --quick   # length 256, tiny-4l-256's shape (15.4M parameters): checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from _timing import interleaved, median, spread

from posfreq.analysis.niah.decoding import Generator, cut_at_eos, generate_answers, teacher_forced
from posfreq.analysis.niah.needles import NiahTest
from posfreq.analysis.niah.settings import CPU_PREFILL_TOKENS, ProbeSettings, parse_lengths
from posfreq.analysis.niah.sources import Builders, checkpoint_source
from posfreq.train.checkpoint.layout import CONSOLIDATED_WEIGHTS, MODEL_CONFIG_FILE, TOKENIZER_FILE
from posfreq.train.data.tokenizer import Tokenizer, get_tokenizer, register_tokenizer
from posfreq.train.model.config import ModelConfig, model_preset
from posfreq.train.model.hf import export_hf
from posfreq.train.model.transformer import Transformer

SMOLLM_135M = model_preset("smollm-135m")
QUICK = model_preset("tiny-4l-256", vocab_size=49_152, tie_embeddings=True)
ASSERTED = 2  # tests per length and batch size whose greedy ids must equal transformers'
CPU = torch.device("cpu")


class FoldedLlama3:
    """Llama-3's tokenization with every id taken modulo `vocab_size` (ids < vocab_size decode as Llama-3's)."""

    def __init__(self, vocab_size: int) -> None:
        self._base = get_tokenizer("llama3")
        self.name = f"llama3-mod{vocab_size}"
        self.vocab_size = vocab_size
        self.bos_id = self._base.bos_id % vocab_size
        self.eos_id = self._base.eos_id % vocab_size
        self.adds_bos = False
        self.fingerprint = f"{self._base.fingerprint}-mod{vocab_size}"

    def encode(self, text: str) -> list[int]:
        return [i % self.vocab_size for i in self._base.encode(text)]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [ids % self.vocab_size for ids in self._base.encode_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._base.decode(ids)


class Recording(Generator):
    """A model behind the probe's Generator protocol that keeps every row `generate` returned (token ids)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.rows: list[list[int]] = []

    def generate(self, *args, **kwargs) -> list[list[int]]:
        rows = self.model.generate(*args, **kwargs)
        self.rows += rows
        return rows

    def target_logprobs(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.target_logprobs(*args, **kwargs)


def save_random_checkpoint(directory: Path, config: ModelConfig, tokenizer: str) -> Path:
    """A seeded random model as a consolidated checkpoint directory (tied weights stored under both names)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Transformer(config)
    directory.mkdir(parents=True)
    save_file(
        {k: v.contiguous().clone() for k, v in model.state_dict().items()},
        str(directory / CONSOLIDATED_WEIGHTS),
    )
    (directory / MODEL_CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    (directory / TOKENIZER_FILE).write_text(
        json.dumps({"spec": tokenizer, "vocab_size": config.vocab_size})
    )
    return directory


def load_transformers(model: Transformer, directory: Path, eos_id: int) -> torch.nn.Module:
    """`model`'s weights as a transformers LlamaForCausalLM (float32, eval), via our Hugging Face export."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    export_hf(model, directory, eos_token_id=eos_id)
    return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def chunks(tests: Sequence[NiahTest], batch: int) -> list[Sequence[NiahTest]]:
    """Consecutive batches of `batch` tests (the last may be shorter), as the probe decodes them."""
    return [tests[i : i + batch] for i in range(0, len(tests), batch)]


def probe_ids(
    model: Recording,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    batch: int,
    new_tokens: int,
    precision: str = "float32",
    prefill_tokens: int | None = CPU_PREFILL_TOKENS,
) -> list[list[int]]:
    """The probe's greedy decoding of `tests`, `batch` at a time (at `precision`); the token ids it generated."""
    model.rows = []
    for chunk in chunks(tests, batch):
        generate_answers(model, tokenizer, chunk, CPU, precision, new_tokens, prefill_tokens)
    return model.rows


def probe_scores(
    model: Recording, tokenizer: Tokenizer, tests: Sequence[NiahTest], batch: int
) -> list[dict]:
    """The probe's teacher-forced needle scores of `tests`, `batch` at a time."""
    return [
        s
        for chunk in chunks(tests, batch)
        for s in teacher_forced(
            model, tokenizer, chunk, CPU, "float32", prefill_tokens=CPU_PREFILL_TOKENS
        )
    ]


def hf_ids(
    hf: torch.nn.Module, tests: Sequence[NiahTest], batch: int, new_tokens: int, eos_id: int
) -> list[list[int]]:
    """transformers' greedy generate on `tests`, `batch` at a time; each row's new token ids cut at EOS."""
    rows: list[list[int]] = []
    for chunk in chunks(tests, batch):
        prompt = torch.from_numpy(np.stack([t.input_ids for t in chunk]))
        with torch.inference_mode():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
            )
        rows += [cut_at_eos(row, eos_id) for row in out[:, prompt.shape[1] :].tolist()]
    return rows


def agreement(ours: list[list[int]], theirs: list[list[int]], eos_id: int, what: str) -> int:
    """How many tests' ids agree; raises when one of the first ASSERTED does not."""
    same = [cut_at_eos(a, eos_id) == b for a, b in zip(ours, theirs)]
    if not all(same[:ASSERTED]):
        raise SystemExit(
            f"{what}: greedy token ids differ from the probe's on test {same.index(False)}"
        )
    return sum(same)


def bench_length(
    model: Recording,
    hf: torch.nn.Module,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    batch: int,
    new_tokens: int,
    repeats: int,
) -> None:
    """Time every row at one length, interleaved over `repeats` rounds, and print medians, spreads and ratios."""
    eos = tokenizer.eos_id
    runs: dict[str, Callable[[], object]] = {
        "probe 1": lambda: probe_ids(model, tokenizer, tests, 1, new_tokens),
        "probe B": lambda: probe_ids(model, tokenizer, tests, batch, new_tokens),
        "probe B, prefill at once": lambda: probe_ids(
            model, tokenizer, tests, batch, new_tokens, prefill_tokens=None
        ),
        "bf16 1": lambda: probe_ids(model, tokenizer, tests, 1, new_tokens, "bfloat16"),
        "bf16-prefill 1": lambda: probe_ids(
            model, tokenizer, tests, 1, new_tokens, "bfloat16-prefill"
        ),
        "bf16-prefill B": lambda: probe_ids(
            model, tokenizer, tests, batch, new_tokens, "bfloat16-prefill"
        ),
        "teacher-forced B": lambda: probe_scores(model, tokenizer, tests, batch),
        "transformers 1": lambda: hf_ids(hf, tests, 1, new_tokens, eos),
        "transformers B": lambda: hf_ids(hf, tests, batch, new_tokens, eos),
    }
    ids: dict[str, object] = {}

    def run(name: str) -> float:
        start = time.perf_counter()
        ids[name] = runs[name]()
        return time.perf_counter() - start

    times = interleaved(
        run, list(runs), repeats, warm_up=False
    )  # main() warmed every implementation up
    one = ids["probe 1"]
    for name in ("probe B", "probe B, prefill at once"):
        if ids[name] != one:
            raise SystemExit(
                f"{name}: batch {batch} generates other tokens than batch 1 on tests "
                f"{[i for i, (a, b) in enumerate(zip(one, ids[name])) if a != b]}"
            )
    print_length(tests, batch, repeats, times, ids, eos)


def print_length(
    tests: Sequence[NiahTest],
    batch: int,
    repeats: int,
    times: dict[str, list[float]],
    ids: dict[str, object],
    eos: int,
) -> None:
    """One length's rows: tests/s with its spread, and each row's ratio to the one it is compared with."""
    n, t, one = len(tests), {name: median(values) for name, values in times.items()}, ids["probe 1"]
    same = {
        name: sum(a == b for a, b in zip(one, ids[name]))
        for name in ("bf16 1", "bf16-prefill 1", "bf16-prefill B")
    }
    same_hf = {
        size: agreement(
            ids[f"probe {size}"], ids[f"transformers {size}"], eos, f"transformers at batch {size}"
        )
        for size in ("1", "B")
    }
    mean_new = np.mean([len(row) for row in one])

    def row(name: str, comparison: str) -> None:
        label = name.replace(" B", f" {batch}")
        print(f"  {label:<28s} {n / t[name]:7.3f} tests/s ({spread(times[name])})  {comparison}")

    print(
        f"length {tests[0].length}: prompt {tests[0].prompt_length} tokens, {n} tests, {mean_new:.1f} new tokens "
        f"per test; median of {repeats} interleaved repeats (spread min-max)"
    )
    row(
        "probe 1",
        f"probe / transformers batch 1: {t['transformers 1'] / t['probe 1']:5.2f}x "
        f"(same ids on {same_hf['1']}/{n} tests)",
    )
    row(
        "probe B",
        f"probe / transformers batch {batch}: {t['transformers B'] / t['probe B']:5.2f}x "
        f"(same ids on {same_hf['B']}/{n}); batch {batch} / batch 1: {t['probe 1'] / t['probe B']:5.2f}x",
    )
    row(
        "probe B, prefill at once",
        f"prefill in {CPU_PREFILL_TOKENS}-token groups / at once: "
        f"{t['probe B, prefill at once'] / t['probe B']:5.2f}x (same ids)",
    )
    row(
        "bf16 1",
        f"vs float32 batch 1: {t['probe 1'] / t['bf16 1']:5.2f}x (same ids as float32 on {same['bf16 1']}/{n})",
    )
    for size in ("1", "B"):
        name = f"bf16-prefill {size}"
        row(
            name,
            f"vs float32: {t[f'probe {size}'] / t[name]:5.2f}x, vs transformers: "
            f"{t[f'transformers {size}'] / t[name]:5.2f}x (same ids as float32 on {same[name]}/{n})",
        )
    row(
        "teacher-forced B",
        f"time per test vs greedy batch {batch}: {t['teacher-forced B'] / t['probe B']:5.3f}x",
    )
    row("transformers 1", "")
    row(
        "transformers B",
        f"batch {batch} / batch 1: {t['transformers 1'] / t['transformers B']:5.2f}x",
    )


def warm_up(model: Recording, hf: torch.nn.Module, tokenizer: Tokenizer, test: NiahTest) -> None:
    """One short run of each implementation, so one-time costs stay out of the timings."""
    probe_ids(model, tokenizer, [test], 1, 2)
    probe_scores(model, tokenizer, [test], 1)
    hf_ids(hf, [test], 1, 2, tokenizer.eos_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--lengths",
        type=parse_lengths,
        help="test lengths in tokens (default 1024,4096; --quick: 256)",
    )
    p.add_argument("--tests", type=int, default=8, help="tests per length, decoded by every row")
    p.add_argument(
        "--batch-size", type=int, default=8, help="the batched setting compared with batch 1"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="the answer budget, all decoded by a random model",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved timed rounds of every row (median reported)",
    )
    p.add_argument(
        "--quick", action="store_true", help="length 256 and tiny-4l-256's shape (same vocabulary)"
    )
    args = p.parse_args()
    lengths = args.lengths or ([256] if args.quick else [1024, 4096])
    config = replace(QUICK if args.quick else SMOLLM_135M, train_len=max(lengths))
    folded = FoldedLlama3(config.vocab_size)
    register_tokenizer(folded.name, lambda: folded)
    settings = ProbeSettings(tests_per_length=args.tests, max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        source = checkpoint_source(
            save_random_checkpoint(Path(tmp) / "random", config, folded.name), settings
        )
        model = source.load(settings, CPU)
        builder = Builders(settings.haystack).for_source(source, settings)
        hf = load_transformers(model, Path(tmp) / "hf", builder.tokenizer.eos_id)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads "
        f"({config.n_kv_heads} KV), FFN {config.ffn_dim}, vocabulary {config.vocab_size}, tied: "
        f"{params / 1e6:.1f}M parameters, random"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads, float32; tokenizer {folded.name}, {args.max_new_tokens} new tokens"
    )
    tests = {n: builder.make_tests(n, args.tests, settings.seed) for n in lengths}
    recording = Recording(model)
    warm_up(recording, hf, builder.tokenizer, tests[lengths[0]][0])
    for n in lengths:
        bench_length(
            recording,
            hf,
            builder.tokenizer,
            tests[n],
            args.batch_size,
            args.max_new_tokens,
            args.repeats,
        )


if __name__ == "__main__":
    main()
