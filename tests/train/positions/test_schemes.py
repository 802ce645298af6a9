"""Position schemes: distance matrices, fast attention vs a slow per-pair reference, STRING decoding, options.
Through the model: tests/train/positions/test_schemes_model.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.positions import (
    HEAD_DIM,
    IDS,
    SETTINGS,
    make_inputs,
    reference_attend,
    scheme_for,
)

import posfreq.train.positions.dca as dca
import posfreq.train.positions.scheme as position_scheme
import posfreq.train.positions.string as string_scheme
from posfreq.train.positions.rotary import RotaryBase
from posfreq.train.positions.schemes import build_scheme

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


@pytest.mark.slow
def test_distance_picture(tmp_path):
    from posfreq.analysis.plots.positions import plot_position_distances

    schemes = [
        scheme_for("rope", {}, 9),
        scheme_for("string", {"shift": 3, "window": 0}, 9),
        scheme_for("string", {"shift": 3, "window": 1}, 9),
    ]
    path = plot_position_distances(schemes, 9, tmp_path / "fig5")[0]
    assert path.stat().st_size > 1000


def test_float32_passes_stay_float32_under_bf16_autocast():
    """The probe runs under bf16 autocast on a GPU: the dense passes documented as float32 must not be cast back."""
    from posfreq.train.model.attention import attend_dense
    from posfreq.train.positions.merge import full_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 16, generator=g)
    k, v = (torch.randn(9, 2, 16, generator=g) for _ in range(2))
    # plain softmax in float64, query head h reading key head h // 2
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, 1)) / 4
    want_lse = torch.logsumexp(scores, -1).T
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double().repeat_interleave(2, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_lse = full_attention(q, k, v)
        out, lse = attend_dense(
            q.transpose(0, 1)[None],
            k[:6].transpose(0, 1)[None],
            v[:6].transpose(0, 1)[None],
            None,
            True,
            True,
            0.25,
        )
    assert got.dtype == got_lse.dtype == torch.float32
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    causal = scores[:, :, :6].masked_fill(torch.ones(6, 6).triu(1).bool(), -torch.inf)
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(causal, -1), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the fused CPU kernel
        fused, fused_lse = full_attention(q, k, v)
    torch.testing.assert_close(fused_lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.double(), want, atol=1e-5, rtol=1e-5)


def test_a_scheme_is_single_pass_exactly_when_its_attention_is_one_causal_pass() -> None:
    """SINGLE_PASS_SCHEMES comes from each scheme's class: the schemes that attend in one causal varlen call
    (RoPE's distances, with the model's frequencies or their own) and not the ones that merge passes."""
    from posfreq.train.positions.schemes import SCHEMES, SINGLE_PASS_SCHEMES

    rope = RotaryBase(16, 10000.0)
    built = {name: build_scheme(name, rope, 256) for name in SCHEMES}
    merged = {name for name, scheme in built.items() if not scheme.single_pass}
    assert set(SINGLE_PASS_SCHEMES) == {"rope", "ntk", "yarn"} == set(SCHEMES) - merged
    for name, scheme in built.items():  # a single-pass scheme sees every distance as m - n
        plain = (scheme.distances(256) == build_scheme("rope", rope, 256).distances(256)).all()
        assert plain == scheme.single_pass, name


def test_the_torch_free_scheme_names_are_the_registered_builders_in_order() -> None:
    """Command lines offer train/positions/names.py's SCHEMES before torch loads; each must be a builder here."""
    from posfreq.train.positions import names, schemes

    assert names.SCHEMES == tuple(schemes._BUILDERS) == schemes.SCHEMES
