"""Peak memory and time of the trainer's loss: full fp32 logits + cross-entropy vs the chunked lean loss.

    python benchmarks/loss.py [--rows 2] [--seq-len 2048] [--vocab 128256] [--d-model 512] [--repeats 3]

Both variants run forward + backward of the summed cross-entropy of hidden (T, d) @ W.T (V, d) in
fp32, T = rows x seq_len, with 5% of the targets ignored: "plain" as the trainer used to (full logits,
then F.cross_entropy), "lean" through `train.model.loss.linear_cross_entropy` (default chunk size). They run
one after the other in this one invocation, each in a fresh subprocess of its own so neither
inherits the other's memory, and the ratios lean / plain are printed at the end.

Memory (CPU, Linux): the subprocess's peak resident set during one forward + backward (VmHWM,
reset through /proc/self/clear_refs just before) minus its resident set at that moment, when the
inputs exist and a warm-up step has run. glibc is told to serve every allocation of 64 KiB or more
with mmap (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set at once: the peak
counts live tensors, not heap kept for reuse. The figure includes the gradients the step produces
(W.grad and hidden.grad, the same for both variants; printed as "grads").
Time: median wall time of `--repeats` forward + backward after the warm-up.
Goal: the lean loss at >= 4x lower peak memory and <= 1.1x the time of the plain one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from posfreq.train.data.packing import IGNORE_INDEX  # noqa: E402
from posfreq.train.model.loss import default_chunk_tokens, linear_cross_entropy  # noqa: E402

VARIANTS = ("plain", "lean")
MIB = 2**20


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def inputs(
    tokens: int, vocab: int, d_model: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and head weight (fp32 leaves) and targets with 5% ignored."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, d_model, generator=g).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=g) / d_model**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[torch.rand(tokens, generator=g) < 0.05] = IGNORE_INDEX
    return hidden, weight, targets


def memory_kib() -> tuple[int, int]:
    """(current, peak) resident set of this process in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def step(loss_fn, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> float:
    """One forward + backward, leaving the gradients in .grad; returns the loss."""
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    loss.backward()
    return loss.item()


def worker(variant: str, args: argparse.Namespace) -> dict:
    """Measure one variant in this process: peak memory of one step, then median time over repeats."""
    loss_fn = plain_loss if variant == "plain" else linear_cross_entropy
    hidden, weight, targets = inputs(args.rows * args.seq_len, args.vocab, args.d_model)
    step(loss_fn, hidden, weight, targets)  # warm-up
    hidden.grad = weight.grad = None
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set to the current one
    before, _ = memory_kib()
    loss = step(loss_fn, hidden, weight, targets)
    _, peak = memory_kib()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step(loss_fn, hidden, weight, targets)
        times.append(time.perf_counter() - start)
    return {
        "variant": variant,
        "loss": loss,
        "peak_mib": (peak - before) / 1024,
        "time_s": statistics.median(times),
        "grads_mib": (hidden.numel() + weight.numel()) * 4 / MIB,
    }


def run_isolated(variant: str, argv: list[str]) -> dict:
    """Run `worker` for one variant in a fresh subprocess (large allocations served by mmap)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--variant", variant],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--variant", choices=VARIANTS, help=argparse.SUPPRESS
    )  # set for the subprocesses
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.variant:
        print(json.dumps(worker(args.variant, args)))
        return
    tokens = args.rows * args.seq_len
    print(
        f"torch {torch.__version__}, {args.threads} threads; T = {args.rows} x {args.seq_len} = {tokens:,} tokens, "
        f"V = {args.vocab:,}, d = {args.d_model}, fp32; lean chunk = {default_chunk_tokens(args.vocab)} tokens; "
        f"forward + backward, median of {args.repeats}"
    )
    print(f"full logits alone: {tokens * args.vocab * 4 / MIB:,.0f} MiB")
    results = {variant: run_isolated(variant, sys.argv[1:]) for variant in VARIANTS}
    print(f"{'variant':8s} {'loss':>14s} {'peak MiB':>10s} {'grads MiB':>10s} {'time s':>8s}")
    for r in results.values():
        print(
            f"{r['variant']:8s} {r['loss']:14.3f} {r['peak_mib']:10,.0f} {r['grads_mib']:10,.0f} {r['time_s']:8.2f}"
        )
    plain, lean = results["plain"], results["lean"]
    print(
        f"lean / plain: peak memory {lean['peak_mib'] / plain['peak_mib']:.3f} "
        f"({plain['peak_mib'] / lean['peak_mib']:.1f}x lower; goal >= 4x), "
        f"time {lean['time_s'] / plain['time_s']:.3f}x (goal <= 1.1x), "
        f"loss relative difference {abs(lean['loss'] / plain['loss'] - 1):.1e}"
    )


if __name__ == "__main__":
    main()
