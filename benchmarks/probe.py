"""NIAH probe throughput: tests/s at batch 1 vs batch 8 on the same tests (answers asserted equal),
and the share of decoding time spent in prefill vs token-by-token decode.

By default a small random model (tiny-2l-128 with the Llama-3 vocabulary) is saved as a
consolidated checkpoint and loaded through the probe's own loader; `--checkpoint DIR` uses a real
one instead (e.g. a demo checkpoint). A random model never writes an answer line, so every row
decodes the full `--max-new-tokens` (default 32, about the length of a real 4-number answer with
the Llama-3 tokenizer); a trained model's rows stop at different steps, and a batch runs until its
slowest row. Prefill time is measured as generate(max_new_tokens=1) on the same batches.

    python benchmarks/probe.py [--checkpoint DIR] [--length 512] [--tests 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.niah import NiahBuilder  # noqa: E402
from analysis.probe import ProbeSettings, generate_answers, load_checkpoint, resolve_precision  # noqa: E402


def save_small_checkpoint(directory: Path) -> Path:
    """A random tiny-2l-128 model with the Llama-3 vocabulary as a consolidated checkpoint directory."""
    from safetensors.torch import save_file

    from train.config import model_preset
    from train.model import Transformer
    from train.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("llama3")
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny-2l-128", vocab_size=tokenizer.vocab_size, max_seq_len=1024))
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "model_config.json").write_text(json.dumps(model.config.to_dict()))
    (directory / "tokenizer_spec.json").write_text(json.dumps(
        {"spec": "llama3", "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}))
    np.save(directory / "trained_lengths.npy", np.bincount([1024], minlength=1025).astype(np.int64))
    return directory


def timed_answers(probe, tests, batch: int, device: torch.device, precision: str, new_tokens: int) -> tuple[float, list[str]]:
    """Seconds and answers of decoding `tests` at `batch` prompts per call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    answers = generate_answers(probe.model, probe.tokenizer, tests, batch, device, precision, new_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory (default: a small random model)")
    p.add_argument("--length", type=int, default=512, help="prompt length in tokens")
    p.add_argument("--tests", type=int, default=16, help="tests decoded at each batch size")
    p.add_argument("--batch-size", type=int, default=8, help="the batched setting compared with batch 1")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    precision = resolve_precision("auto", device)
    settings = ProbeSettings(tests_per_length=args.tests, haystack="pg", precision=precision)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or save_small_checkpoint(Path(tmp) / "small")
        probe = load_checkpoint(path, settings, device)
    tests = NiahBuilder(probe.tokenizer, "pg").make_tests(args.length, args.tests, seed=0)
    params = sum(p.numel() for p in probe.model.parameters())
    print(f"model {probe.name} ({params / 1e6:.1f}M parameters), {args.tests} tests of {args.length} tokens, "
          f"<= {args.max_new_tokens} new tokens, {device} {precision}, torch threads {torch.get_num_threads()}")
    timed_answers(probe, tests[: args.batch_size], args.batch_size, device, precision, 2)  # warm-up
    results = {}
    for batch in (1, args.batch_size):
        seconds, answers = timed_answers(probe, tests, batch, device, precision, args.max_new_tokens)
        prefill, _ = timed_answers(probe, tests, batch, device, precision, 1)
        results[batch] = (seconds, prefill, answers)
        print(f"batch {batch:2d}: {args.tests / seconds:7.2f} tests/s  ({seconds:6.2f} s; prefill "
              f"{100 * prefill / seconds:4.1f}%, decode {100 * (1 - prefill / seconds):4.1f}%)")
    one, many = results[1][2], results[args.batch_size][2]
    mismatched = [i for i, (a, b) in enumerate(zip(one, many)) if a != b]
    if mismatched:
        raise SystemExit(f"batch 1 and batch {args.batch_size} answers differ on tests {mismatched}")
    speedup = results[1][0] / results[args.batch_size][0]
    print(f"same answers at batch 1 and {args.batch_size}; speedup {speedup:.2f}x (goal >= 4x on CPU at batch 8)")


if __name__ == "__main__":
    main()
