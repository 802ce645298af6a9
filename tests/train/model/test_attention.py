"""Per-document attention: every backend equals a naive per-document softmax reference."""

from __future__ import annotations

import math

import pytest
import torch

from posfreq.train.model.attention import varlen_attention
from posfreq.train.model.attention_kernels import BackendError, available_backends, resolve_backend


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
                keys = [
                    j
                    for j in range(lk)
                    if 0 <= i + lk - lq - j and (window is None or i + lk - lq - j < window)
                ]
                if not keys:
                    continue
                scores = torch.stack(
                    [q[sq + i, h] @ k[sk + j, h // groups] for j in keys]
                ) / math.sqrt(q.shape[-1])
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
        out, lse = varlen_attention(
            q, k, v, cu(lens_q), cu(lens_k), 5, 6, window=3, return_lse=True, backend="sdpa"
        )
    ref, ref_lse = naive_attention(q, k, v, lens_q, lens_k, window=3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
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
    with pytest.raises(BackendError, match="unknown attention backend"):
        resolve_backend("magic", "cpu")
    with pytest.raises(BackendError, match="runs on cuda only, not cpu"):
        resolve_backend("flash", "cpu")
    assert resolve_backend("auto", "cpu") == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("backend", ["varlen", "flash", "xformers", "flex"])
def test_gpu_backends_match_sdpa_forward_lse_window_and_backward(backend):
    """The doctor's check: bf16 against sdpa in float32 (forward, lse, Lq < Lk, window, backward)."""
    from posfreq.train.preflight.checks import Skipped, attention_check

    try:
        attention_check(backend, torch.device("cuda"))
    except Skipped as why:
        pytest.skip(str(why))


# ------------------------------------------------------------------ backend resolution and the CUDA adapters
# What the kernels can run, from the libraries' sources (torch 2.13 varlen.py / aten flash, flash-attn 2.8.3,
# xformers 0.0.33, flex_attention.py), written out apart from train/model/attention.py's own table.


def kernel_can_run(name, device, dtype, lse, backward):
    half = dtype in (torch.bfloat16, torch.float16)
    return {
        "sdpa": True,
        "varlen": device == "cuda"
        and half,  # FlashAttention refuses float32; its backward drops d(lse)
        "flash": device == "cuda" and half,
        "xformers": device == "cuda" and not lse,
        "flex": device == "cuda" or not backward,  # no backward on CPU
    }[name] and not (backward and lse and name in ("varlen", "flash"))


@pytest.mark.parametrize("present", [set(), {"varlen"}, {"flash"}, {"varlen", "flash", "xformers"}])
def test_resolution_never_returns_a_kernel_that_cannot_run_the_call(monkeypatch, present):
    import posfreq.train.model.attention_kernels as attention_kernels

    monkeypatch.setattr(
        attention_kernels,
        "kernel_present",
        lambda name: name in present or name in ("sdpa", "flex"),
    )
    for backend in attention_kernels.BACKENDS:
        for device in ("cpu", "cuda"):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for lse in (False, True):
                    for backward in (False, True):
                        call = dict(return_lse=lse, backward=backward)
                        try:
                            name = resolve_backend(backend, device, dtype, **call)
                        except BackendError as err:
                            assert backend != "auto", (
                                err
                            )  # auto always finds one (sdpa runs everything)
                            assert not (
                                backend in present | {"sdpa", "flex"}
                                and kernel_can_run(backend, device, dtype, lse, backward)
                            ), err
                            suggested = str(err).split("Fix: choose '")[1].split("'")[0]
                            assert kernel_can_run(suggested, device, dtype, lse, backward), err
                            continue
                        assert name in present | {"sdpa", "flex"} and kernel_can_run(
                            name, device, dtype, lse, backward
                        )
                        if backend != "auto":
                            assert name == backend
    # auto's preference on a GPU: torch's varlen FlashAttention, then flash-attn, then sdpa
    assert resolve_backend("auto", "cuda", torch.bfloat16) == (
        "varlen" if "varlen" in present else "flash" if "flash" in present else "sdpa"
    )
    assert (
        resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    )  # fp32 on CUDA: never a FlashAttention kernel
    assert resolve_backend("auto", "cuda", torch.bfloat16, return_lse=True, backward=True) == "sdpa"


def test_the_names_a_parser_lists_are_the_kernel_table_and_auto():
    """train/model/backend_names.py (read by parsers without torch) names exactly the kernels, plus auto."""
    from posfreq.train.model import attention_kernels
    from posfreq.train.model.backend_names import BACKENDS

    assert BACKENDS[0] == "auto" and set(BACKENDS[1:]) == set(attention_kernels.KERNELS)
    assert len(set(BACKENDS)) == len(BACKENDS)


def test_two_pass_merge_refuses_kernels_that_drop_the_lse_gradient(monkeypatch):
    import posfreq.train.model.attention_kernels as attention_kernels

    monkeypatch.setattr(attention_kernels, "kernel_present", lambda name: True)
    for name in ("varlen", "flash"):
        resolve_backend(name, "cuda", torch.bfloat16, return_lse=True)  # inference: fine
        with pytest.raises(BackendError, match="ignores the log-sum-exp's gradient"):
            resolve_backend(name, "cuda", torch.bfloat16, return_lse=True, backward=True)


def flash_double(q, k, v, cu_q, cu_k, window_size, is_causal, scale):
    """FlashAttention's varlen contract: fp16/bf16 only, int32 cu_seqlens, bottom-right (left, right) windows,
    grouped heads as they are, log-sum-exp as (H, Tq) float32."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    assert cu_q.dtype == cu_k.dtype == torch.int32
    left, right = window_size
    right = 0 if is_causal else right
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf)
    groups = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        i = (
            torch.arange(b - a)[:, None] + (d - c) - (b - a)
        )  # the key position of each query's diagonal
        j = torch.arange(d - c)[None, :]
        ok = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
        kk, vv = (x[c:d].float().repeat_interleave(groups, 1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), kk) * scale
        scores = scores.masked_fill(~ok, -math.inf)
        lse[:, a:b] = torch.logsumexp(scores, -1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1).nan_to_num(0.0), vv)
    return out.to(q.dtype), lse


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_and_flash_adapters_against_flashattention_doubles(monkeypatch, window):
    import sys
    import types

    import torch.nn.attention.varlen as torch_varlen

    import posfreq.train.model.attention as attention

    varlen_attn = varlen_attn_of_release("2.13")  # torch 2.13's signature (the others: below)

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        out, lse = flash_double(
            q, k, v, cu_seqlens_q, cu_seqlens_k, window_size, causal, softmax_scale
        )
        return (out, lse, None) if return_attn_probs else out

    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    monkeypatch.setitem(
        sys.modules,
        "flash_attn",
        types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func),
    )
    lens_q, lens_k = [3, 1, 6], [6, 4, 6]
    q, k, v = packed(lens_q, 4, 8, 21), packed(lens_k, 2, 8, 22), packed(lens_k, 2, 8, 23)
    ref, ref_lse = naive_attention(q, k, v, lens_q, lens_k, window=window)
    for impl in (attention._varlen, attention._flash):
        args = (
            cu(lens_q).long(),
            cu(lens_k).long(),
            6,
            6,
            window,
        )  # int64 cu_seqlens: the adapter converts
        with pytest.raises(RuntimeError, match="fp16 and bf16"):
            impl(q, k, v, *args, False, 8**-0.5)
        out, lse = impl(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args, True, 8**-0.5)
        assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse.double(), ref_lse, atol=3e-2, rtol=3e-2)


def varlen_attn_of_release(release):
    """Doubles of `torch.nn.attention.varlen.varlen_attn` with each release's signature (read from torch's
    varlen.py at v2.10.0, v2.11.0 and v2.12.0/v2.13.0): 2.10 says causal by is_causal, has no scale (the kernel
    uses 1 / sqrt(D)) and no window; 2.11 says causal by window_size == (-1, 0) and takes scale; 2.12 adds
    enable_gqa and refuses unequal head counts without it. Each accepts only its own keywords. Every release's
    FlashAttention-2 kernel takes grouped heads as they are (2.10 and 2.11 have no guard); each double records
    the key/value head count it was given in `received`."""

    def run(q, k, v, cu_q, cu_k, window_size, is_causal, scale, return_aux, gqa):
        if q.shape[1] != k.shape[1] and not gqa:
            raise RuntimeError("Expect number of query heads to be equal to number of key heads")
        received.append(k.shape[1])
        out, lse = flash_double(q, k, v, cu_q, cu_k, window_size, is_causal, scale)
        return (out, lse) if return_aux is not None and return_aux.lse else out

    def v2_10(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
    ):
        return run(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            (-1, -1),
            is_causal,
            query.shape[-1] ** -0.5,
            return_aux,
            True,
        )

    def v2_11(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
    ):
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        causal = window_size == (-1, 0)
        return run(
            query, key, value, cu_seq_q, cu_seq_k, window_size, causal, scale, return_aux, True
        )

    def v2_13(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        causal = window_size == (-1, 0)
        return run(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            window_size,
            causal,
            scale,
            return_aux,
            enable_gqa,
        )

    received: list[int] = []
    double = {"2.10": v2_10, "2.11": v2_11, "2.13": v2_13}[release]
    double.received = received
    return double


@pytest.mark.parametrize("release", ["2.10", "2.11", "2.13"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_varlen_adapter_runs_every_torch_release_signature(
    monkeypatch, release, window, heads, kv_heads
):
    import torch.nn.attention.varlen as torch_varlen

    import posfreq.train.model.attention as attention
    import posfreq.train.model.attention_kernels as attention_kernels

    double = varlen_attn_of_release(release)
    monkeypatch.setattr(torch_varlen, "varlen_attn", double)
    monkeypatch.setattr(attention_kernels, "kernel_present", lambda name: True)
    lens_q, lens_k = [3, 1, 6], [6, 4, 6]
    q, k, v = (
        packed(lens_q, heads, 8, 31),
        packed(lens_k, kv_heads, 8, 32),
        packed(lens_k, kv_heads, 8, 33),
    )
    scale = 0.2  # not 1 / sqrt(8): a release without `scale` must fold it in
    ref, ref_lse = naive_attention(q * (scale * 8**0.5), k, v, lens_q, lens_k, window=window)
    args = (cu(lens_q).long(), cu(lens_k).long(), 6, 6, window)  # int64: the adapter converts
    bf16 = [x.bfloat16() for x in (q, k, v)]
    if window is not None and release == "2.10":
        with pytest.raises(BackendError, match="no sliding window.*torch >= 2.11"):
            attention_kernels.resolve_backend("varlen", "cuda", torch.bfloat16, window=True)
        with pytest.raises(BackendError, match="no sliding window"):
            attention._varlen(*bf16, *args, True, scale)
        # auto takes a kernel that can (sdpa here: flash-attn is not installed), and says why not varlen
        monkeypatch.setattr(
            attention_kernels, "kernel_present", lambda name: name in ("varlen", "sdpa")
        )
        name, why = attention_kernels.explain_backend("auto", "cuda", torch.bfloat16, window=True)
        assert name == "sdpa" and "no sliding window" in why
        return
    assert (
        attention_kernels.resolve_backend("auto", "cuda", torch.bfloat16, window=window is not None)
        == "varlen"
    )
    out, lse = attention._varlen(*bf16, *args, True, scale)
    assert double.received == [
        kv_heads
    ]  # grouped heads reach the kernel unrepeated, on every release
    assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=3e-2, rtol=3e-2)
    if heads != kv_heads:  # grouped heads: gradients reach the unrepeated key/value heads
        leaves = [x.detach().requires_grad_() for x in bf16]
        attention._varlen(*leaves, *args, False, scale).float().sum().backward()
        assert leaves[1].grad.shape == k.shape and leaves[1].grad.abs().sum() > 0


@pytest.mark.parametrize("window", [None, 5])
def test_flex_block_mask_is_the_document_causal_mask_padded_to_a_power_of_two(window):
    from torch.nn.attention.flex_attention import create_block_mask

    from posfreq.train.model.attention_flex import flex_block_mask, flex_padded_length

    lens_q, lens_k = (
        [1, 140, 3, 60],
        [9, 140, 200, 60],
    )  # crosses block edges; fewer queries than keys
    mask = flex_block_mask(cu(lens_q), cu(lens_k), sum(lens_q), sum(lens_k), window)
    assert mask.seq_lengths == (256, 512) == (flex_padded_length(204), flex_padded_length(409))
    dense = mask.to_dense()  # (1, 1, blocks_q, blocks_k): which blocks are computed at all
    want = torch.zeros(256, 512, dtype=torch.bool)  # the naive element mask
    sq = sk = 0
    for lq, lk in zip(lens_q, lens_k):
        for i in range(lq):
            for j in range(lk):
                d = i + lk - lq - j
                want[sq + i, sk + j] = d >= 0 and (window is None or d < window)
        sq, sk = sq + lq, sk + lk
    blocks = want.view(2, 128, 4, 128).any(3).any(1)
    assert torch.equal(dense[0, 0].bool(), blocks)

    def mask_mod(b, h, qi, ki):
        return want[qi, ki]

    reference = create_block_mask(mask_mod, 1, 1, 256, 512, device="cpu")
    assert torch.equal(reference.to_dense(), dense)


def test_flex_mask_is_built_once_per_forward_not_per_layer(monkeypatch):
    import posfreq.train.model.attention_flex as attention_flex
    from posfreq.train.model.config import model_preset
    from posfreq.train.model.transformer import Transformer

    built = []
    real = attention_flex._document_positions
    monkeypatch.setattr(
        attention_flex, "_document_positions", lambda *a, **k: built.append(1) or real(*a, **k)
    )
    model = Transformer(
        model_preset("tiny-2l-128", vocab_size=97, n_layers=3), attention_backend="flex"
    ).eval()
    ids = torch.randint(0, 97, (40,))
    lens = torch.tensor([0, 15, 40], dtype=torch.int32)
    with torch.no_grad():
        flex = model(ids, lens, 25)
        assert len(built) == 2  # queries and keys, once for the three layers
        model.attention_backend = "sdpa"
        torch.testing.assert_close(model(ids, lens, 25), flex, atol=1e-4, rtol=1e-4)


def xformers_double():
    """xformers 0.0.33's contract (ops/fmha/__init__.py, attn_bias.py): `memory_efficient_attention` is the autograd
    entry; the grouped 5-D layout (1, T, Hkv, G, D) has no backward op (refused at the forward when grads are
    needed); masks come from `from_seqlens` and `make_local_attention_from_bottomright(w)` (keys at distance < w)."""
    import types

    class BottomRight:
        def __init__(self, q_seqlen, kv_seqlen, window=None):
            assert all(k >= q for q, k in zip(q_seqlen, kv_seqlen)), (
                "num_keys >= num_queries per block"
            )
            self.q_seqlen, self.kv_seqlen, self.window = list(q_seqlen), list(kv_seqlen), window

        @classmethod
        def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
            return cls(q_seqlen, kv_seqlen or q_seqlen)

        def make_local_attention_from_bottomright(self, window_size):
            assert window_size > 0
            return BottomRight(self.q_seqlen, self.kv_seqlen, window_size)

        def materialize(self):
            mask = torch.zeros(sum(self.q_seqlen), sum(self.kv_seqlen), dtype=torch.bool)
            sq = sk = 0
            for lq, lk in zip(self.q_seqlen, self.kv_seqlen):
                d = torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)[None, :]
                mask[sq : sq + lq, sk : sk + lk] = (d >= 0) & (
                    (d < self.window) if self.window else True
                )
                sq, sk = sq + lq, sk + lk
            return mask

    def memory_efficient_attention(
        query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None
    ):
        if (
            query.ndim == 5
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in (query, key, value))
        ):
            raise NotImplementedError("operator does not support BMGHK format")
        shape = query.shape
        q, k, v = (
            x.reshape(x.shape[1], -1, x.shape[-1]) for x in (query, key, value)
        )  # (T, heads, D)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~attn_bias.materialize(), -math.inf)
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(shape)

    attn_bias = types.SimpleNamespace(BlockDiagonalCausalFromBottomRightMask=BottomRight)
    fmha = types.SimpleNamespace(
        attn_bias=attn_bias, memory_efficient_attention=memory_efficient_attention
    )
    return types.SimpleNamespace(ops=types.SimpleNamespace(fmha=fmha))


@pytest.mark.parametrize("window", [None, 2])
def test_xformers_adapter_trains_through_the_autograd_api(monkeypatch, window):
    import sys

    import posfreq.train.model.attention as attention

    fake = xformers_double()
    monkeypatch.setitem(sys.modules, "xformers", fake)
    monkeypatch.setitem(sys.modules, "xformers.ops", fake.ops)
    mask_class = fake.ops.fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask
    built = []
    real_from_seqlens = mask_class.from_seqlens
    monkeypatch.setattr(
        mask_class,
        "from_seqlens",
        lambda *a, **kw: built.append(1) or real_from_seqlens(*a, **kw),
    )
    lens_q, lens_k = [2, 5, 1], [4, 5, 3]
    q, k, v = (
        packed(lens, h, 8, s).requires_grad_()
        for lens, h, s in ((lens_q, 4, 31), (lens_k, 2, 32), (lens_k, 2, 33))
    )
    args = (cu(lens_q), cu(lens_k), 5, 5, window, False, 8**-0.5)
    with torch.no_grad():  # inference keeps the grouped 5-D layout
        torch.testing.assert_close(
            attention._xformers(q, k, v, *args).double(),
            naive_attention(q, k, v, lens_q, lens_k, window)[0],
            atol=1e-5,
            rtol=1e-5,
        )
    attention._xformers(q, k, v, *args).pow(2).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    naive_attention(qd, kd, vd, lens_q, lens_k, window)[0].pow(2).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    # the mask is built from the lengths on the host once for these cu_seqlens, not once per call (layer)
    assert len(built) == 1


def test_the_varlen_double_of_the_installed_torch_has_its_real_signature():
    """The hand-written doubles cannot drift from the installed torch: the double for this release takes the same
    parameters, in the same order, of the same kinds and with the same defaults as torch's own varlen_attn (the
    doubles of other releases were read from their sources; only the installed one can be checked here)."""
    import inspect

    varlen = pytest.importorskip("torch.nn.attention.varlen")
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    release = {(2, 10): "2.10", (2, 11): "2.11", (2, 12): "2.13", (2, 13): "2.13"}.get(
        (major, minor)
    )
    if release is None:
        pytest.skip(f"no double written for torch {torch.__version__}")
    real = inspect.signature(varlen.varlen_attn).parameters
    double = inspect.signature(varlen_attn_of_release(release)).parameters
    assert list(double) == list(real)
    for name, parameter in real.items():
        assert double[name].kind == parameter.kind, name
        assert double[name].default == parameter.default, name
