"""Position schemes: distance matrices, fast attention vs a slow per-pair reference, model prefill and cached decoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import posfreq.train.attention as attention
import posfreq.train.attention_merge as attention_merge
import posfreq.train.dca as dca
import posfreq.train.position_scheme as position_scheme
import posfreq.train.string_scheme as string_scheme
from posfreq.train.attention_merge import AttentionInputs
from posfreq.train.config import ModelConfig
from posfreq.train.model import Transformer, positions_in_sequences, uniform_cu_seqlens
from posfreq.train.position_scheme import PositionScheme
from posfreq.train.positions import build_scheme
from posfreq.train.rotary import RotaryBase

HEAD_DIM = 16


# ----------------------------------------------------------------------------- slow reference


def reference_attend(scheme: PositionScheme, x: AttentionInputs) -> torch.Tensor:
    """Slow reference, independent of the fast passes: for every pair (m, n <= m) the query is
    rotated at n + d(m, n), with d read from `scheme.distances`, against the key cached at n,
    so the pair sees exactly distance d; softmax over the whole row, in float32."""
    q, k, v = x.q.float(), x.k.float(), x.v.float()
    heads, dim = q.shape[1], q.shape[2]
    groups = heads // k.shape[1]
    out = torch.zeros_like(q)
    cu_q, cu_k = x.cu_seqlens_q.tolist(), x.cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        lq, lk = q1 - q0, k1 - k0
        table = torch.from_numpy(scheme.distances(lk))
        m, n = x.pos_q[q0:q1], x.pos_k[k0:k1]
        dist = table[m][:, n]  # (lq, lk), -1 where n > m
        pair_pos = n[None, :] + dist.clamp_min(0)
        q_pairs = q[q0:q1, None].expand(lq, lk, heads, dim).reshape(lq * lk, heads, dim)
        q_pairs = scheme.rotary.rotate(q_pairs, pair_pos.reshape(-1)).view(lq, lk, heads, dim)
        keys = k[k0:k1].repeat_interleave(groups, dim=1)
        scores = (q_pairs * keys[None]).sum(-1) / math.sqrt(dim)  # (lq, lk, H)
        scores = scores.masked_fill((dist < 0)[..., None], -math.inf)
        probs = torch.softmax(scores, dim=1)
        out[q0:q1] = torch.einsum("qkh,khd->qhd", probs, v[k0:k1].repeat_interleave(groups, dim=1))
    return out.to(x.q.dtype)


class ReferenceScheme(PositionScheme):
    """A scheme that attends through `reference_attend`, to plug into a model."""

    def __init__(self, scheme: PositionScheme) -> None:
        super().__init__(
            name=f"reference-{scheme.name}", rotary=scheme.rotary, options=scheme.options
        )
        self.scheme = scheme

    def attend(self, x: AttentionInputs) -> torch.Tensor:
        return reference_attend(self.scheme, x)


# ----------------------------------------------------------------------------- inputs


def make_inputs(
    scheme, lens_k, lens_q=None, heads=4, kv_heads=2, dtype=torch.float32, seed=0
) -> AttentionInputs:
    """Random packed inputs; keys rotated at their true positions by the scheme's rotary, as the model does."""
    lens_q = lens_q or lens_k
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(np.cumsum([0, *lens_q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *lens_k]), dtype=torch.int32)
    pos_k = positions_in_sequences(cu_k, int(cu_k[-1]))
    pos_q = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(lens_q, lens_k)])
    q = torch.randn(int(cu_q[-1]), heads, HEAD_DIM, generator=gen)
    k = scheme.rotary.rotate(torch.randn(int(cu_k[-1]), kv_heads, HEAD_DIM, generator=gen), pos_k)
    v = torch.randn(int(cu_k[-1]), kv_heads, HEAD_DIM, generator=gen)
    return AttentionInputs(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        pos_q,
        pos_k,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        "sdpa",
    )


SETTINGS = [
    ("rope", {}),
    ("string", {"shift": 7, "window": 2}),
    ("string", {"shift": 12, "window": 0}),
    ("string", {"shift": 5, "window": 4, "temperature": True}),
    ("string", {}),  # defaults for train_len 48: shift 16, window 8
    ("rerope", {"window": 5}),
    ("rerope", {"window": 1}),
    ("self_extend", {"group": 3, "window": 4}),
    ("self_extend", {"group": 2, "window": 9}),
    ("dca", {"chunk_size": 9, "local_window": 2}),
    ("dca", {"chunk_size": 16, "local_window": 5}),
    ("ntk", {}),
    ("yarn", {"scale": 2.0}),
]
IDS = [
    f"{name}-{'-'.join(f'{k}{v}' for k, v in opts.items()) or 'default'}" for name, opts in SETTINGS
]


def scheme_for(name: str, options: dict, train_len: int = 48) -> PositionScheme:
    return build_scheme(name, RotaryBase(HEAD_DIM), train_len, **options)


# ----------------------------------------------------------------------------- distance matrices


def test_string_matrix_paper_example():
    scheme = scheme_for("string", {"shift": 3, "window": 0}, train_len=9)
    assert scheme.distances(9)[-1].tolist() == [5, 4, 3, 2, 1, 0, 2, 1, 0]
    assert scheme.distances(9)[3, :4].tolist() == [0, 2, 1, 0]


@pytest.mark.parametrize("shift,window", [(10, 3), (7, 1), (12, 11)])
def test_string_window_keeps_the_nearest_keys_nearest(shift, window):
    length = 40
    dist = scheme_for("string", {"shift": shift, "window": window}).distances(length)
    for m in range(length):
        row = dist[m, : m + 1]
        near = np.arange(m + 1) > m - window  # the `window` nearest keys
        assert sorted(row[near].tolist()) == list(range(min(window, m + 1)))
        assert (row[~near] >= window).all()
        assert row.max() <= max(shift - 1, length - 1 - shift + window)


def test_baseline_matrices_by_hand():
    rerope = scheme_for("rerope", {"window": 4}).distances(12)
    assert rerope[11].tolist() == [4] * 8 + [3, 2, 1, 0]
    se = scheme_for("self_extend", {"group": 2, "window": 4}).distances(11)
    # m=10: grouped 10//2 - n//2 + 4 - 4//2 for distances >= 4, plain below.
    assert se[10].tolist() == [7, 7, 6, 6, 5, 5, 4, 3, 2, 1, 0]
    dca = scheme_for("dca", {"chunk_size": 6, "local_window": 2}).distances(10)  # chunk length 4
    # m=9 sits in chunk 2 at offset 1: older chunk min(2*4-1, 6) - n%4, previous min(1+4, 6) - n%4, own m-n.
    assert dca[9].tolist() == [6, 5, 4, 3, 5, 4, 3, 2, 1, 0]
    assert dca.max() <= 6
    for name in ("ntk", "yarn", "rope"):
        assert (scheme_for(name, {}).distances(6) == scheme_for("rope", {}).distances(6)).all()


# ----------------------------------------------------------------------------- fast == reference


LAYOUTS = {
    "prefill": ([3, 17, 40, 40], None),  # several documents in one packed row, two of equal length
    "cached": (
        [17, 40, 25],
        [1, 6, 3],
    ),  # the last queries of each sequence against its cached keys
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,options", SETTINGS, ids=IDS)
def test_fast_equals_reference(name, options, layout, monkeypatch):
    lens_k, lens_q = LAYOUTS[layout]
    scheme = scheme_for(name, options)
    for block, (heads, kv_heads), grad in (
        (256, (4, 2), False),
        (8, (4, 1), False),
        (5, (4, 4), True),
    ):
        monkeypatch.setattr(dca, "DENSE_BLOCK", block)
        x = make_inputs(scheme, lens_k, lens_q, heads, kv_heads, seed=block)
        with torch.set_grad_enabled(grad):
            fast = scheme.attend(x)
        torch.testing.assert_close(fast, reference_attend(scheme, x), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name,options", SETTINGS[1:], ids=IDS[1:])
def test_bf16_close_to_float32_reference(name, options, monkeypatch):
    scheme = scheme_for(name, options)
    x = make_inputs(scheme, [17, 40], dtype=torch.bfloat16)
    with torch.no_grad():
        fast = scheme.attend(x)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(
        fast.float(), reference_attend(scheme, x).float(), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize(
    "options",
    [
        {"shift": 7, "window": 2},
        {"shift": 12, "window": 0},
        {"shift": 5, "window": 4, "temperature": True},
    ],
)
@pytest.mark.parametrize("len_q", [1, 3, 9])
@pytest.mark.parametrize("batch", [1, 2])
def test_string_one_pass_decode_equals_reference_and_two_pass(options, len_q, batch, monkeypatch):
    """Cached decoding (equal sequences, len_q < len_k) takes `StringScheme.decode`: one pass per
    layer, both query rotations scored against slices of the cached keys, one softmax. It equals
    the per-pair reference and the two-pass (window + shifted, log-sum-exp) path, single tokens
    and chunks, with caches shorter than, at and beyond the shift and chunks straddling it."""
    scheme = scheme_for("string", options)
    shift = options["shift"]
    calls = []
    one_pass = string_scheme.StringScheme.decode

    def recorded(self, q, k, v, pos_q, batch_, len_q_, len_k):
        calls.append(len_k)
        return one_pass(self, q, k, v, pos_q, batch_, len_q_, len_k)

    monkeypatch.setattr(string_scheme.StringScheme, "decode", recorded)
    for block in (64, 2):  # DECODE_BLOCK 2 splits chunks into query blocks
        monkeypatch.setattr(string_scheme, "DECODE_BLOCK", block)
        for len_k in sorted(
            {
                len_q + 1,
                shift - 1,
                shift,
                shift + 1,
                shift + len_q - 1,
                shift + len_q,
                2 * shift + 5,
                40,
            }
        ):
            if len_k <= len_q:
                continue
            x = make_inputs(scheme, [len_k] * batch, [len_q] * batch, seed=len_k)
            fast = scheme.attend(x)
            torch.testing.assert_close(fast, reference_attend(scheme, x), atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(
                fast, position_scheme.SplitScheme.attend(scheme, x), atol=2e-5, rtol=2e-5
            )
    assert calls and min(calls) > shift  # the one-pass path ran, and only beyond the shift


def test_string_shorter_than_shift_is_rope_bit_for_bit():
    string, rope = scheme_for("string", {"shift": 41, "window": 8}), scheme_for("rope", {})
    x = make_inputs(rope, [3, 17, 40])
    assert torch.equal(string.attend(x), rope.attend(x))


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


# ----------------------------------------------------------------------------- frequencies, options, plots


def test_yarn_matches_hugging_face():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for train_len, scale in ((2048, None), (4096, 4.0)):
        scheme = build_scheme(
            "yarn", RotaryBase(64), train_len, **({} if scale is None else {"scale": scale})
        )
        original = round(2 * train_len / 3)
        config = LlamaConfig(
            hidden_size=64 * 4,
            num_attention_heads=4,
            max_position_embeddings=train_len,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": scale or 1.5,
                "original_max_position_embeddings": original,
            },
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        torch.testing.assert_close(scheme.rotary.inv_freq, inv_freq, atol=0, rtol=1e-6)
        assert scheme.rotary.scale == pytest.approx(factor)


def test_ntk_raises_the_base_and_protocols():
    scheme = build_scheme("ntk", RotaryBase(64), 2048)
    expected = 1.0 / (10_000.0 * 1.5 ** (64 / 62)) ** (torch.arange(0, 64, 2).float() / 64)
    torch.testing.assert_close(scheme.rotary.inv_freq, expected)
    native = build_scheme("ntk", RotaryBase(64), 2048, protocol="native")
    torch.testing.assert_close(
        native.rotary.inv_freq, build_scheme("rope", RotaryBase(64), 2048).rotary.inv_freq
    )
    assert (
        build_scheme("self_extend", RotaryBase(64), 2048, protocol="native").options["group"] == 1
    )
    paper = build_scheme("self_extend", RotaryBase(64), 2048).options
    assert paper["window"] == 341 and paper["group"] == 2
    assert build_scheme("dca", RotaryBase(64), 2048).options == {
        "chunk_size": 1023,
        "local_window": 85,
        "protocol": "paper",
    }
    assert build_scheme("string", RotaryBase(64), 2048).options == {
        "shift": 682,
        "window": 128,
        "temperature": False,
    }


def test_schemes_keep_a_scaled_base_and_frequency_schemes_refuse_it():
    """A checkpoint's rope_scaling stays under every scheme but ntk and yarn, which replace the frequencies and refuse it."""
    scaled = RotaryBase(HEAD_DIM, 10_000.0, {"rope_type": "linear", "factor": 2.0})
    expected = 1.0 / 10_000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM) / 2.0
    for name, options in SETTINGS:
        if name in ("ntk", "yarn"):
            with pytest.raises(ValueError, match="replaces RoPE's frequencies.*rope_scaling"):
                build_scheme(name, scaled, 48, **options)
            unscaled = build_scheme(
                name, RotaryBase(HEAD_DIM, 10_000.0, {"rope_type": "default"}), 48, **options
            )
            assert unscaled.rotary.inv_freq[0] == 1.0  # the default type is no scaling
        else:
            torch.testing.assert_close(
                build_scheme(name, scaled, 48, **options).rotary.inv_freq, expected
            )


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("string", {"shift": 4, "window": 4}, "window < shift"),
        ("string", {"sift": 4}, "does not take"),
        ("rope", {"window": 3}, "does not take"),
        ("ntk", {"protocol": "mine"}, "unknown protocol"),
        ("bogus", {}, "unknown position scheme"),
    ],
)
def test_bad_options_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        build_scheme(name, RotaryBase(HEAD_DIM), 48, **options)


def test_distance_picture(tmp_path):
    from posfreq.analysis.plots_positions import plot_position_distances

    schemes = [
        scheme_for("rope", {}, 9),
        scheme_for("string", {"shift": 3, "window": 0}, 9),
        scheme_for("string", {"shift": 3, "window": 1}, 9),
    ]
    path = plot_position_distances(schemes, 9, tmp_path / "fig5")[0]
    assert path.stat().st_size > 1000


def test_float32_passes_stay_float32_under_bf16_autocast():
    """The probe runs under bf16 autocast on a GPU: the dense passes documented as float32 must not be cast back."""
    from posfreq.train.attention import _attend_dense
    from posfreq.train.attention_merge import dense_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 4, 16, generator=g) for _ in range(3))
    allowed = torch.rand(6, 6, generator=g) > 0.3
    allowed[:, 0] = True
    want = dense_attention(q.double(), k.double(), v.double(), allowed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dense_attention(q, k, v, allowed)
        out, lse = _attend_dense(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            True,
            True,
            0.25,
        )
    torch.testing.assert_close(got[1].double(), want[1].double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0].double(), want[0].double(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        plain = _attend_dense(
            q.transpose(0, 1)[None].double(),
            k.transpose(0, 1)[None].double(),
            v.transpose(0, 1)[None].double(),
            None,
            True,
            True,
            0.25,
        )
    torch.testing.assert_close(lse.double(), plain[1].double(), atol=1e-5, rtol=1e-5)
