"""NIAH probe decoding throughput on a SmolLM-135M-shaped model, side by side with its alternatives.

For each test length (default 1,024 and 4,096 tokens: a prompt of length - max_new_tokens plus
the answer budget), on the same seeded tests, it prints as ratios measured in the same run:

1. tests/s of the probe's greedy decoding (`analysis.probe.generate_answers`, KV cache) at batch 1
   and at `--batch-size` (default 8); the generated token ids must be equal (asserted);
   at batch 1 under `--precision bfloat16` (CPU autocast of everything), and at both batch sizes under
   `--precision bfloat16-prefill` (the prompt's forward in bf16, the cache and the decoding steps in
   float32); the token ids agreeing with float32 are counted, not asserted: bf16 rounding changes near-ties;
2. the teacher-forced score (`analysis.probe.teacher_forced`, one forward pass per batch) vs greedy
   decoding, as time per test at `--batch-size`;
3. Hugging Face `transformers` (`LlamaForCausalLM.generate`, greedy, float32) on the same weights
   (exported with `train.hf.export_hf`), the same prompts and the same max_new_tokens, at batch 1
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
The default run takes 10-20 minutes on 2 cores (one 4K test is about 1.5 TFLOP, decoded about 40
times over the comparisons); `--lengths 1024` alone takes a few minutes.

    python benchmarks/probe.py [--lengths 1024,4096] [--tests 8] [--batch-size 8] [--max-new-tokens 32]
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
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch


from posfreq.analysis.niah import NiahTest  # noqa: E402
from posfreq.analysis.probe import (  # noqa: E402
    Builders,
    ProbeSettings,
    checkpoint_source,
    cut_at_eos,
    generate_answers,
    parse_lengths,
    teacher_forced,
)
from posfreq.train.config import ModelConfig, model_preset  # noqa: E402
from posfreq.train.hf import export_hf  # noqa: E402
from posfreq.train.model import Transformer  # noqa: E402
from posfreq.train.tokenizer import Tokenizer, get_tokenizer, register_tokenizer  # noqa: E402

SMOLLM_135M = model_preset("smollm-135m")
QUICK = model_preset("tiny-4l-256", vocab_size=49_152, tie_embeddings=True)
ASSERTED = 2  # tests per length and batch size whose greedy ids must equal transformers'
CPU = torch.device("cpu")
T = TypeVar("T")


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


class Recording:
    """A model behind the probe's Generator protocol that keeps every row `generate` returned (token ids)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.rows: list[list[int]] = []

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 stop: Callable[[int, list[int]], bool] | None = None,
                 prefill_dtype: torch.dtype | None = None) -> list[list[int]]:
        rows = self.model.generate(prompt_ids, max_new_tokens, stop=stop, prefill_dtype=prefill_dtype)
        self.rows += rows
        return rows

    def target_logprobs(self, input_ids: torch.Tensor, first_target: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.target_logprobs(input_ids, first_target)


def save_random_checkpoint(directory: Path, config: ModelConfig, tokenizer: str) -> Path:
    """A seeded random model as a consolidated checkpoint directory (tied weights stored under both names)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Transformer(config)
    directory.mkdir(parents=True)
    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "model_config.json").write_text(json.dumps(config.to_dict()))
    (directory / "tokenizer_spec.json").write_text(json.dumps({"spec": tokenizer, "vocab_size": config.vocab_size}))
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


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds and result of fn()."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def probe_ids(model: Recording, tokenizer: Tokenizer, tests: Sequence[NiahTest], batch: int,
              new_tokens: int, precision: str = "float32") -> list[list[int]]:
    """The probe's greedy decoding of `tests`, `batch` at a time (at `precision`); the token ids it generated."""
    model.rows = []
    for chunk in chunks(tests, batch):
        generate_answers(model, tokenizer, chunk, CPU, precision, new_tokens)
    return model.rows


def probe_scores(model: Recording, tokenizer: Tokenizer, tests: Sequence[NiahTest], batch: int) -> list[dict]:
    """The probe's teacher-forced needle scores of `tests`, `batch` at a time."""
    return [s for chunk in chunks(tests, batch) for s in teacher_forced(model, tokenizer, chunk, CPU, "float32")]


def hf_ids(hf: torch.nn.Module, tests: Sequence[NiahTest], batch: int, new_tokens: int, eos_id: int) -> list[list[int]]:
    """transformers' greedy generate on `tests`, `batch` at a time; each row's new token ids cut at EOS."""
    rows: list[list[int]] = []
    for chunk in chunks(tests, batch):
        prompt = torch.from_numpy(np.stack([t.input_ids for t in chunk]))
        with torch.inference_mode():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id)
        rows += [cut_at_eos(row, eos_id) for row in out[:, prompt.shape[1] :].tolist()]
    return rows


def agreement(ours: list[list[int]], theirs: list[list[int]], eos_id: int, what: str) -> int:
    """How many tests' ids agree; raises when one of the first ASSERTED does not."""
    same = [cut_at_eos(a, eos_id) == b for a, b in zip(ours, theirs)]
    if not all(same[:ASSERTED]):
        raise SystemExit(f"{what}: greedy token ids differ from the probe's on test {same.index(False)}")
    return sum(same)


def bench_length(model: Recording, hf: torch.nn.Module, tokenizer: Tokenizer, tests: Sequence[NiahTest], batch: int,
                 new_tokens: int) -> None:
    """Time every row at one length and print it with its ratio."""
    n, eos = len(tests), tokenizer.eos_id
    hf_one, theirs_one = timed(lambda: hf_ids(hf, tests, 1, new_tokens, eos))
    hf_many, theirs_many = timed(lambda: hf_ids(hf, tests, batch, new_tokens, eos))
    one, ids_one = timed(lambda: probe_ids(model, tokenizer, tests, 1, new_tokens))
    many, ids_many = timed(lambda: probe_ids(model, tokenizer, tests, batch, new_tokens))
    if ids_one != ids_many:
        raise SystemExit(f"batch 1 and batch {batch} generate different tokens on tests "
                         f"{[i for i, (a, b) in enumerate(zip(ids_one, ids_many)) if a != b]}")
    bf16, ids_bf16 = timed(lambda: probe_ids(model, tokenizer, tests, 1, new_tokens, "bfloat16"))
    same_bf16 = sum(a == b for a, b in zip(ids_one, ids_bf16))
    pre_one, ids_pre_one = timed(lambda: probe_ids(model, tokenizer, tests, 1, new_tokens, "bfloat16-prefill"))
    pre_many, ids_pre_many = timed(lambda: probe_ids(model, tokenizer, tests, batch, new_tokens, "bfloat16-prefill"))
    same_pre = [sum(a == b for a, b in zip(ids_one, ids)) for ids in (ids_pre_one, ids_pre_many)]
    forced, _ = timed(lambda: probe_scores(model, tokenizer, tests, batch))
    same_one = agreement(ids_one, theirs_one, eos, "transformers at batch 1")
    same_many = agreement(ids_many, theirs_many, eos, f"transformers at batch {batch}")
    mean_new = np.mean([len(ids) for ids in ids_one])
    print(f"length {tests[0].length}: prompt {tests[0].prompt_length} tokens, {n} tests, {mean_new:.1f} new tokens "
          f"per test")
    print(f"  probe greedy    batch 1    {n / one:8.3f} tests/s")
    print(f"  probe greedy    batch {batch:<4d} {n / many:8.3f} tests/s   batch {batch} / batch 1: {one / many:5.2f}x "
          "(same token ids)")
    print(f"  probe bf16      batch 1    {n / bf16:8.3f} tests/s   bf16 / float32 batch 1: {one / bf16:5.2f}x "
          f"(same ids as float32 on {same_bf16}/{n} tests)")
    for size, seconds, same, hf_seconds in ((1, pre_one, same_pre[0], hf_one), (batch, pre_many, same_pre[1], hf_many)):
        print(f"  probe bf16-prefill batch {size:<4d} {n / seconds:8.3f} tests/s   vs float32 same batch: "
              f"{(one if size == 1 else many) / seconds:5.2f}x, vs transformers (float32) same batch: "
              f"{hf_seconds / seconds:5.2f}x (same ids as float32 on {same}/{n} tests)")
    print(f"  teacher-forced  batch {batch:<4d} {n / forced:8.3f} tests/s   time per test vs greedy batch {batch}: "
          f"{forced / many:5.3f}x")
    print(f"  transformers    batch 1    {n / hf_one:8.3f} tests/s   probe / transformers: {hf_one / one:5.2f}x "
          f"(same ids on {same_one}/{n} tests)")
    print(f"  transformers    batch {batch:<4d} {n / hf_many:8.3f} tests/s   probe / transformers: "
          f"{hf_many / many:5.2f}x (same ids on {same_many}/{n} tests)")


def warm_up(model: Recording, hf: torch.nn.Module, tokenizer: Tokenizer, test: NiahTest) -> None:
    """One short run of each implementation, so one-time costs stay out of the timings."""
    probe_ids(model, tokenizer, [test], 1, 2)
    probe_scores(model, tokenizer, [test], 1)
    hf_ids(hf, [test], 1, 2, tokenizer.eos_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=parse_lengths, help="test lengths in tokens (default 1024,4096; --quick: 256)")
    p.add_argument("--tests", type=int, default=8, help="tests per length, decoded by every row")
    p.add_argument("--batch-size", type=int, default=8, help="the batched setting compared with batch 1")
    p.add_argument("--max-new-tokens", type=int, default=32, help="the answer budget, all decoded by a random model")
    p.add_argument("--quick", action="store_true", help="length 256 and tiny-4l-256's shape (same vocabulary)")
    args = p.parse_args()
    lengths = args.lengths or ([256] if args.quick else [1024, 4096])
    config = replace(QUICK if args.quick else SMOLLM_135M, train_len=max(lengths))
    folded = FoldedLlama3(config.vocab_size)
    register_tokenizer(folded.name, lambda: folded)
    settings = ProbeSettings(tests_per_length=args.tests, max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        source = checkpoint_source(save_random_checkpoint(Path(tmp) / "random", config, folded.name), settings)
        model = source.load(settings, CPU)
        builder = Builders(settings.haystack).for_source(source, settings)
        hf = load_transformers(model, Path(tmp) / "hf", builder.tokenizer.eos_id)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads "
          f"({config.n_kv_heads} KV), FFN {config.ffn_dim}, vocabulary {config.vocab_size}, tied: "
          f"{params / 1e6:.1f}M parameters, random")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"with {torch.get_num_threads()} threads, float32; tokenizer {folded.name}, {args.max_new_tokens} new tokens")
    tests = {n: builder.make_tests(n, args.tests, settings.seed) for n in lengths}
    recording = Recording(model)
    warm_up(recording, hf, builder.tokenizer, tests[lengths[0]][0])
    for n in lengths:
        bench_length(recording, hf, builder.tokenizer, tests[n], args.batch_size, args.max_new_tokens)


if __name__ == "__main__":
    main()
