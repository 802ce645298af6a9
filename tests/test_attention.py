"""Per-document attention: every backend equals a naive per-document softmax reference."""

from __future__ import annotations

import math

import pytest
import torch

from posfreq.train.attention import available_backends, resolve_backend, varlen_attention


def naive_attention(q, k, v, lens_q, lens_k, window=None):
    """O(L^2) float64 reference: loop over documents and query positions, explicit softmax."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    sq = sk = 0
    for lq, lk in zip(lens_q, lens_k):
        for i in range(lq):
            for h in range(q.shape[1]):
                keys = [j for j in range(lk) if 0 <= i + lk - lq - j and (window is None or i + lk - lq - j < window)]
                if not keys:
                    continue
                scores = torch.stack([q[sq + i, h] @ k[sk + j, h // groups] for j in keys]) / math.sqrt(q.shape[-1])
                weights = torch.softmax(scores, 0)
                out[sq + i, h] = sum(w * v[sk + j, h // groups] for w, j in zip(weights, keys))
                lse[sq + i, h] = torch.logsumexp(scores, 0)
        sq, sk = sq + lq, sk + lk
    return out, lse


def packed(lens, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lens), heads, dim, generator=g)


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


CPU_BACKENDS = [b for b in available_backends("cpu") if b != "flex"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_backend_matches_reference(backend, heads, kv_heads):
    lens = [7, 1, 12, 7, 3]
    q, k, v = packed(lens, heads, 8, 1), packed(lens, kv_heads, 8, 2), packed(lens, kv_heads, 8, 3)
    out = varlen_attention(q, k, v, cu(lens), cu(lens), max(lens), max(lens), backend=backend)
    ref, _ = naive_attention(q, k, v, lens, lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grad", [False, True])
def test_lse_window_and_bottom_right_alignment(grad):
    lens_q, lens_k = [3, 1, 5], [6, 4, 5]
    q, k, v = packed(lens_q, 4, 8, 4), packed(lens_k, 2, 8, 5), packed(lens_k, 2, 8, 6)
    with torch.set_grad_enabled(grad):
        out, lse = varlen_attention(q, k, v, cu(lens_q), cu(lens_k), 5, 6, window=3, return_lse=True, backend="sdpa")
    ref, ref_lse = naive_attention(q, k, v, lens_q, lens_k, window=3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_flex_forward_on_cpu_matches_reference():
    # FlexAttention has no backward on CPU, so it is checked forward-only here.
    lens = [5, 9, 2]
    q, k, v = packed(lens, 2, 16, 7), packed(lens, 2, 16, 8), packed(lens, 2, 16, 9)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu(lens), cu(lens), 9, 9, backend="flex")
    ref, _ = naive_attention(q, k, v, lens, lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_documents_do_not_see_each_other():
    lens = [6, 6]
    q, k, v = packed(lens, 2, 8, 10), packed(lens, 2, 8, 11), packed(lens, 2, 8, 12)
    base = varlen_attention(q, k, v, cu(lens), cu(lens), 6, 6, backend="sdpa")
    k2, v2 = k.clone(), v.clone()
    k2[:6] += 5.0
    v2[:6] -= 3.0
    changed = varlen_attention(q, k2, v2, cu(lens), cu(lens), 6, 6, backend="sdpa")
    assert torch.equal(base[6:], changed[6:])
    assert not torch.allclose(base[:6], changed[:6])


def test_gradients_match_reference():
    lens = [4, 6]
    q, k, v = (packed(lens, 2, 8, s).requires_grad_() for s in (13, 14, 15))
    varlen_attention(q, k, v, cu(lens), cu(lens), 6, 6, backend="sdpa").pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    naive_attention(qd, kd, vd, lens, lens)[0].pow(2).sum().backward()
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_backend_errors_are_clear():
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("magic", "cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        resolve_backend("flash", "cpu")
    assert resolve_backend("auto", "cpu") == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("backend", ["flash", "xformers", "flex", "sdpa"])
def test_gpu_backends_match_reference(backend):
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not installed")
    lens = [100, 3, 257, 64]
    q, k, v = (packed(lens, h, 64, s).cuda().bfloat16() for h, s in ((8, 1), (2, 2), (2, 3)))
    out = varlen_attention(q, k, v, cu(lens).cuda(), cu(lens).cuda(), 257, 257, backend=backend)
    ref = varlen_attention(q.float(), k.float(), v.float(), cu(lens).cuda(), cu(lens).cuda(), 257, 257, backend="sdpa")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
