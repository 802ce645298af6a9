"""Position schemes through the model: prefill, cached and chunked decoding against the slow reference,
bf16 beyond every split, and a cache that is never packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.positions import ReferenceScheme

import posfreq.train.model.attention as attention
import posfreq.train.positions.dca as dca
import posfreq.train.positions.merge as attention_merge
from posfreq.train.model.config import ModelConfig
from posfreq.train.model.transformer import Transformer, uniform_cu_seqlens

# ----------------------------------------------------------------------------- through the model

CONFIG = ModelConfig(
    vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, train_len=36
)
MODEL_SETTINGS = [
    ("rope", {}),  # cached decoding over the cache's strided views, never packed
    ("string", {}),  # shift 12, window 6
    ("string", {"shift": 9, "window": 3, "temperature": True}),
    ("rerope", {}),  # protocol paper: L' = 24, window 6
    ("self_extend", {}),  # window 6, group 2
    ("dca", {}),  # chunk_size 18, local_window 1
    ("ntk", {}),
    ("yarn", {}),
]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG, attention_backend="sdpa").eval()


def _with_scheme(model: Transformer, name: str, options: dict, reference: bool) -> Transformer:
    model.set_positions(name, **options)
    if reference:
        model.positions = ReferenceScheme(model.positions)
    return model


@pytest.mark.parametrize(
    "name,options", MODEL_SETTINGS, ids=[n + str(len(o)) for n, o in MODEL_SETTINGS]
)
def test_model_prefill_and_cached_decoding(model, name, options, monkeypatch):
    monkeypatch.setattr(dca, "DENSE_BLOCK", 8)
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, CONFIG.vocab_size, (7 + 30 + 45,), generator=gen)
    cu = torch.tensor([0, 7, 37, 82], dtype=torch.int32)
    prompt = torch.randint(0, CONFIG.vocab_size, (2, 20), generator=gen)
    steps = torch.randint(0, CONFIG.vocab_size, (2, 10), generator=gen)
    with torch.no_grad():
        results = {}
        for reference in (False, True):
            m = _with_scheme(model, name, options, reference)
            logits = m(packed, cu)
            generated = m.generate(prompt, max_new_tokens=8)
            # Step-by-step cached decoding of given tokens, against a full forward of the whole sequence.
            caches = m.new_caches(2, 30, torch.float32, prompt.device)
            hidden = [
                m.hidden_states(
                    prompt.reshape(-1), uniform_cu_seqlens(2, 20, "cpu"), 20, caches
                ).view(2, 20, -1)[:, -1]
            ]
            for t in range(steps.shape[1]):
                hidden.append(
                    m.hidden_states(
                        steps[:, t],
                        uniform_cu_seqlens(2, 1, "cpu"),
                        1,
                        caches,
                        position_offset=caches[0].length,
                    )
                )
            results[reference] = (logits, generated, torch.stack(hidden, 1))
        full = m.hidden_states(
            torch.cat([prompt, steps], 1).reshape(-1), uniform_cu_seqlens(2, 30, "cpu"), 30
        )
    (logits, generated, stepwise), (ref_logits, ref_generated, ref_stepwise) = (
        results[False],
        results[True],
    )
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert generated == ref_generated
    torch.testing.assert_close(stepwise, ref_stepwise, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref_stepwise, full.view(2, 30, -1)[:, 19:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("grouped", [64, 4])
@pytest.mark.parametrize(
    "name,options",
    [("string", {}), ("string", {"shift": 9, "window": 3, "temperature": True}), ("rope", {})],
)
def test_model_chunked_decoding_equals_full_forward(model, name, options, grouped, monkeypatch):
    """Chunks of new tokens on a KV cache (STRING's one-pass decode; RoPE's attention over the cache's views, by
    matmuls up to `grouped` new queries and by sdpa's kernel beyond), below and beyond the shift, equal a full
    forward."""
    monkeypatch.setattr(attention, "GROUPED_QUERIES", grouped)
    m = _with_scheme(model, name, options, False)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, 34), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        full = m.hidden_states(tokens.reshape(-1), uniform_cu_seqlens(2, 34, "cpu"), 34).view(
            2, 34, -1
        )
        caches = m.new_caches(2, 34, torch.float32, tokens.device)
        start, chunks = 0, []
        for size in (
            5,
            1,
            4,
            7,
            1,
            3,
            13,
        ):  # crosses the shift (12 or 9) inside a chunk and between chunks
            cu = uniform_cu_seqlens(2, size, "cpu")
            ids = tokens[:, start : start + size].reshape(-1)
            chunks.append(
                m.hidden_states(ids, cu, size, caches, position_offset=start).view(2, size, -1)
            )
            start += size
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["rope", "string"])
def test_cached_decoding_never_packs_the_cache(model, name, monkeypatch):
    """Batched decoding steps read the KV cache through its strided views: packing it would copy the whole cache at
    every step and layer (the cost that made batch 8 slower than batch 1 at 4K tokens)."""
    m = _with_scheme(model, name, {}, False)
    prompt = torch.randint(
        0, CONFIG.vocab_size, (3, 20), generator=torch.Generator().manual_seed(4)
    )
    caches = m.new_caches(3, 30, torch.float32, prompt.device)

    def refuse(self):
        raise AssertionError("the KV cache was packed")

    with torch.no_grad():
        m.hidden_states(prompt.reshape(-1), uniform_cu_seqlens(3, 20, "cpu"), 20, caches)
        monkeypatch.setattr(attention_merge.AttentionInputs, "k", property(refuse))
        monkeypatch.setattr(attention_merge.AttentionInputs, "v", property(refuse))
        for size in (1, 1, 4):
            ids = prompt[:, :size].reshape(-1)
            m.hidden_states(
                ids,
                uniform_cu_seqlens(3, size, "cpu"),
                size,
                caches,
                position_offset=caches[0].length,
            )
    assert caches[0].length == 26


def test_model_string_equals_rope_below_shift(model):
    tokens = torch.randint(0, CONFIG.vocab_size, (3, 12))
    with torch.no_grad():
        rope = _with_scheme(model, "rope", {}, False)(tokens)
        string = _with_scheme(model, "string", {}, False)(tokens)  # shift 12: every distance < 12
    assert torch.equal(rope, string)


@pytest.mark.parametrize("name", ["rope", "string", "rerope", "self_extend", "dca"])
def test_bf16_prefill_with_every_split_scheme_beyond_its_split(model, name):
    """generate(prefill_dtype=bfloat16) with a prompt longer than the split: the prefill attends over its own bf16
    keys (the float32 cache is only read by the float32 decoding steps), and the answer equals the one from a
    bf16-autocast prefill done by hand followed by float32 steps."""
    m = _with_scheme(model, name, {}, False)
    prompt = torch.randint(
        0, CONFIG.vocab_size, (2, 30), generator=torch.Generator().manual_seed(6)
    )
    with torch.inference_mode():
        generated = m.generate(prompt, 4, prefill_dtype=torch.bfloat16)
        caches = m.new_caches(2, 34, torch.float32, prompt.device)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = m.hidden_states(
                prompt.reshape(-1), uniform_cu_seqlens(2, 30, "cpu"), 30, caches
            )
        ids = m.lm_head(hidden.view(2, 30, -1)[:, -1].float()).argmax(-1)
        expected = [ids]
        for _ in range(3):
            step = m.hidden_states(
                ids, uniform_cu_seqlens(2, 1, "cpu"), 1, caches, position_offset=caches[0].length
            )
            ids = m.lm_head(step).argmax(-1)
            expected.append(ids)
    assert caches[0].k.dtype == torch.float32
    assert generated == torch.stack(expected, 1).tolist()


def test_model_bf16_generate_runs(model):
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16)
    prompt = torch.randint(0, CONFIG.vocab_size, (2, 30))
    for name in ("string", "rerope", "self_extend", "dca", "yarn"):
        half.set_positions(name)
        out = half.generate(prompt, max_new_tokens=2)
        assert len(out) == 2 and all(len(row) == 2 for row in out)


def tiny_model_with(layers: int, scheme: str) -> Transformer:
    """A 97-token tiny model of `layers` layers (train_len 48) on sdpa, in eval mode, running `scheme`."""
    from posfreq.train.model.config import model_preset

    model = Transformer(
        model_preset("tiny-2l-128", vocab_size=97, n_layers=layers, train_len=48),
        attention_backend="sdpa",
    ).eval()
    model.set_positions(scheme)
    return model


def test_a_split_scheme_reads_its_layout_once_per_forward_not_per_layer(monkeypatch):
    """The far pass's segments come from cu_seqlens through host copies (a GPU sync each): computed once for
    the layers of one forward, again for a new forward's tensors, and the rotary copies its frequencies once."""

    calls = []
    real = attention_merge.Segments.of
    monkeypatch.setattr(
        attention_merge.Segments, "of", staticmethod(lambda *a: calls.append(1) or real(*a))
    )
    model = tiny_model_with(3, "string")
    ids = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(ids, torch.tensor([0, 40, 90], dtype=torch.int32), 50)
        assert len(calls) == 1  # three layers, one layout
        again = model(ids, torch.tensor([0, 40, 90], dtype=torch.int32), 50)
        assert len(calls) == 2  # a new forward's cu_seqlens: read again
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    rotary = model.positions.rotary
    assert rotary.inv_freq_on(ids.device) is rotary.inv_freq_on(ids.device)


def test_sdpa_reads_the_packed_layout_once_per_forward_not_per_layer(monkeypatch):
    """sdpa groups packed sequences by shape from cu_seqlens on the host (a GPU sync per read): once for the
    layers of one forward, and each group's output lands in its own rows."""
    from posfreq.train.model.config import model_preset

    reads = []
    real = attention._shape_groups
    monkeypatch.setattr(attention, "_shape_groups", lambda *a: reads.append(1) or real(*a))
    model = Transformer(
        model_preset("tiny-2l-128", vocab_size=97, n_layers=3, train_len=48),
        attention_backend="sdpa",
    ).eval()
    ids = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor(
        [0, 40, 50, 90], dtype=torch.int32
    )  # two of 40 (not back to back) and one of 10
    with torch.no_grad():
        packed = model(ids, cu, 40)
        assert len(reads) == 1  # three layers, one layout
        alone = [
            model(ids[a:b], torch.tensor([0, b - a], dtype=torch.int32), b - a)
            for a, b in ((0, 40), (40, 50), (50, 90))
        ]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    # STRING's near and far passes alternate two layouts in every layer: both stay memoized
    counts = []
    for layers in (2, 5):
        model = tiny_model_with(layers, "string")
        reads.clear()
        with torch.no_grad():
            model(ids, cu.clone(), 40)  # a new forward's layout
        counts.append(len(reads))
    assert counts[0] == counts[1] > 0, counts


def test_a_max_seqlen_above_the_longest_sequence_changes_nothing():
    """max_seqlen may overstate the longest sequence (an upper bound, as in FlashAttention): sdpa's window
    split then has no sequence with a second block, which crashed STRING, and the output is the exact one's."""
    # split 16, window 8: no sequence below reaches a second window block
    model = tiny_model_with(2, "string")
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(ids, torch.tensor([0, 6, 13], dtype=torch.int32), 7)
        loose = model(ids, torch.tensor([0, 6, 13], dtype=torch.int32), 100)
    torch.testing.assert_close(loose, exact, rtol=0, atol=0)
    # a split given as a numpy integer keys the far pass's memos like an int
    scheme = model.positions
    scheme.split = np.int64(scheme.split)
    assert np.int64(16) in scheme._scalar_settings()


@pytest.mark.parametrize("scheme", ["string", "rerope", "self_extend"])
def test_a_split_scheme_computes_cos_sin_once_per_forward_not_per_layer(monkeypatch, scheme):
    """A split scheme rotates queries at two positions tensors per layer (true and far): each layer after the
    first reuses both cos/sin tables, so a forward's count does not grow with the number of layers."""
    from posfreq.train.positions.rotary import Rotary

    computed = []
    real = Rotary.inv_freq_on  # called exactly when cos/sin are computed afresh
    monkeypatch.setattr(Rotary, "inv_freq_on", lambda self, d: computed.append(1) or real(self, d))
    counts = []
    for layers in (2, 5):
        model = tiny_model_with(layers, scheme)
        ids = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(0))
        computed.clear()
        with torch.no_grad():
            model(ids, torch.tensor([0, 40, 90], dtype=torch.int32), 50)
        counts.append(len(computed))
    # true positions (queries, keys) and the far queries'
    assert counts[0] == counts[1] <= 3, counts


def test_string_decoding_computes_cos_sin_once_per_step_not_per_layer(monkeypatch):
    """Each cached decoding step rotates STRING's queries at their positions and the far shift of them: every
    layer after the first reuses that step's cos/sin, so generating costs the same count for 2 and 5 layers."""
    from posfreq.train.model.config import model_preset
    from posfreq.train.positions.rotary import Rotary

    computed = []
    real = Rotary.inv_freq_on  # called exactly when cos/sin are computed afresh
    monkeypatch.setattr(Rotary, "inv_freq_on", lambda self, d: computed.append(1) or real(self, d))
    prompt = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    counts, outputs = [], []
    for layers in (2, 5):
        torch.manual_seed(0)
        model = Transformer(
            model_preset("tiny-2l-128", vocab_size=97, n_layers=layers, train_len=48),
            attention_backend="sdpa",
        ).eval()
        model.set_positions("string")  # split 16 < 30: every step has far keys
        computed.clear()
        outputs.append(model.generate(prompt, max_new_tokens=4))
        counts.append(len(computed))
    assert counts[0] == counts[1] > 0, counts
    assert all(len(row) == 4 for out in outputs for row in out)


@pytest.mark.parametrize("cu", [[0, 40, 90], [0, 90]], ids=["two", "one"])
@pytest.mark.parametrize("scheme", ["string", "rerope", "self_extend", "dca"])
def test_gradients_flow_through_a_split_schemes_merge(scheme, cu):
    """The merge weighted the passes by exp(...) made finite in place, which autograd refused ("modified by an
    inplace operation") in any backward through STRING, ReRoPE or Self-Extend; with one sequence (its rows a
    slice) it overwrote views that backward needs, and DCA merged into its dense passes' outputs, which backward
    needs too. The gradients equal the per-pair reference's."""
    from posfreq.train.model.config import model_preset

    torch.manual_seed(0)
    model = Transformer(
        model_preset("tiny-2l-128", vocab_size=97, train_len=48), attention_backend="sdpa"
    )
    ids = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor(cu, dtype=torch.int32)
    grads = {}
    for reference in (False, True):
        model.zero_grad()
        _with_scheme(model, scheme, {}, reference)
        model(ids, cu, int((cu[1:] - cu[:-1]).max())).float().logsumexp(-1).mean().backward()
        grads[reference] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert grads[False] and all(torch.isfinite(g).all() for g in grads[False])
    for got, want in zip(grads[False], grads[True]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
