"""Per-document attention time of each available backend vs a per-document loop of plain SDPA.

Row length 2048, 8 heads of 64, document mixes drawn like packed pretraining rows. Prints
forward and forward+backward times and their ratio to the loop (lower is better). The loop is
what a user would write by hand; the dense block-diagonal mask is shown as the naive
alternative. Run: python benchmarks/attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from posfreq.train.model.attention import varlen_attention
from posfreq.train.model.attention_kernels import available_backends


def document_mixes(row: int) -> dict[str, list[int]]:
    """Realistic segment mixes for one packed row (the last segment absorbs any remainder)."""
    return {
        "4 docs": [row // 4] * 4,
        "skewed (SlimPajama-like)": [900, 400, 300, 200, 120, 80, 48],
        "1 doc": [row],
    }


def loop_reference(q, k, v, lens):
    """The hand-written alternative: one causal SDPA call per document."""
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True
            ).transpose(0, 1)
        )
        start += n
    return torch.cat(outs)


def dense_mask(q, k, v, lens):
    """The naive alternative: one SDPA call over the row with a block-diagonal causal mask."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)


def timed(fn, backward: bool, repeats: int) -> float:
    """Median seconds of fn() (and its backward) over `repeats` runs after one warm-up."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = fn()
        if backward:
            out.sum().backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--row", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    backends = [b for b in available_backends("cpu") if b != "flex"]  # flex: no backward on CPU
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, row {args.row}, 8 heads x 64"
    )
    print(
        f"{'mix':28s} {'impl':10s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'vs loop (fwd, f+b)':>20s}"
    )
    for name, lens in document_mixes(args.row).items():
        lens[-1] += args.row - sum(lens)
        q, k, v = (torch.randn(args.row, 8, 64, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        impls = {
            "loop": lambda q=q, k=k, v=v, lens=lens: loop_reference(q, k, v, lens),
            "dense-mask": lambda q=q, k=k, v=v, lens=lens: dense_mask(q, k, v, lens),
        }
        longest = max(lens)
        for b in backends:
            impls[b] = lambda b=b, q=q, k=k, v=v, cu=cu, n=longest: varlen_attention(
                q, k, v, cu, cu, n, n, backend=b
            )
        base = None
        for impl, fn in impls.items():
            fwd = timed(fn, False, args.repeats)
            both = timed(fn, True, args.repeats)
            base = base or (fwd, both)
            print(
                f"{name:28s} {impl:10s} {fwd * 1e3:8.1f} {both * 1e3:11.1f} {fwd / base[0]:9.2f}x {both / base[1]:8.2f}x"
            )


if __name__ == "__main__":
    main()
