"""Every model type the position schemes accept (hf_rows.VERIFIED_MODEL_TYPES), against a per-pair reference that
knows nothing of posfreq: each layer's q and k are captured before the model's *own* rotary function, and every
(query m, key n) pair at distance >= the scheme's split is scored with that function applied at the scheme's
positions for the pair; nearer pairs keep the model's own rotation. So a model whose rotary layout, direction,
scaling or NoPE layers differ from what posfreq assumes fails here, and the refusals name what is not modeled."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from helpers.hf import SMALL_DECODER

transformers = pytest.importorskip("transformers")

from posfreq.analysis.niah.hf_engine import cache_keyword  # noqa: E402
from posfreq.train.positions.hf_rows import (  # noqa: E402
    VERIFIED_MODEL_TYPES,
    packed_layout,
    refuse_unsupported,
)
from posfreq.train.positions.hf_schemes import apply_scheme  # noqa: E402

REFERENCE = "posfreq_per_pair_reference"
LENGTH = 200
SMALL = dict(
    SMALL_DECODER,
    max_position_embeddings=256,
    initializer_range=0.1,  # sharper attention than the default, so positions show in the logits
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
EXPERTS = dict(num_experts_per_tok=2)
EXTRA = {
    "gemma": dict(head_dim=16),
    "granite": dict(attention_multiplier=0.5),  # not 1/sqrt(head size): folded into the queries
    "granitemoe": dict(attention_multiplier=0.5, num_local_experts=4, **EXPERTS),
    "mistral": dict(sliding_window=None),
    "mixtral": dict(sliding_window=None, num_local_experts=4, **EXPERTS),
    "olmoe": dict(num_experts=4, **EXPERTS),
    "phi3": dict(sliding_window=None),
    "qwen2_moe": dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **EXPERTS
    ),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, moe_intermediate_size=32, **EXPERTS),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=False),  # one NoPE layer of two
    "starcoder2": dict(sliding_window=None),
}


@dataclass(frozen=True)
class Pairs:
    """A scheme as positions: a pair at distance >= split has its query at query(m) and its key at key(n)."""

    split: int
    query: Callable[[torch.Tensor], torch.Tensor]
    key: Callable[[torch.Tensor], torch.Tensor]


# scheme name, its options (train length 96 for the baselines' defaults), and its positions (the papers' formulas)
SCHEMES = {
    "string": ({"shift": 48, "window": 8}, Pairs(48, lambda m: m - 48 + 8, lambda n: n)),
    "self_extend": (
        {"group": 4, "window": 32},
        Pairs(32, lambda m: m // 4 + 32 - 32 // 4, lambda n: n // 4),
    ),
    "rerope": (
        {"window": 32},
        Pairs(32, lambda m: torch.full_like(m, 32), lambda n: torch.zeros_like(n)),
    ),
}

CAPTURED: list[dict] = []


def capture_rotary(model_type: str, monkeypatch) -> None:
    """Wrap the modeling module's apply_rotary_pos_emb so each call leaves its inputs and outputs for the reference."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = module.apply_rotary_pos_emb

    def recorded(q, k, cos, sin, *args, **kwargs):
        out = original(q, k, cos, sin, *args, **kwargs)
        CAPTURED.append(dict(q=q, k=k, cos=cos, sin=sin, args=args, kwargs=kwargs, out=out))
        return out

    recorded.original = original
    monkeypatch.setattr(module, "apply_rotary_pos_emb", recorded)


def reference_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Eager attention in float64 (one unpadded row, L queries over L keys) with the pairs of config._pairs moved."""
    pairs: Pairs | None = getattr(module.config, "_pairs", None)
    call = CAPTURED.pop() if CAPTURED else None  # none in a NoPE layer
    heads, length = query.shape[1], query.shape[2]
    groups = heads // key.shape[1]
    scores = query.double() @ key.repeat_interleave(groups, 1).double().transpose(-1, -2)
    if pairs is not None and call is not None:
        assert torch.equal(call["out"][0], query) and torch.equal(call["out"][1], key)
        rotate = importlib.import_module(type(module).__module__).apply_rotary_pos_emb.original

        def at(positions: torch.Tensor, which: int) -> torch.Tensor:
            cos, sin = call["cos"][:, positions], call["sin"][:, positions]
            return rotate(call["q"], call["k"], cos, sin, *call["args"], **call["kwargs"])[which]

        m = torch.arange(length)
        far = at(pairs.query(m), 0).double() @ at(pairs.key(m), 1).repeat_interleave(
            groups, 1
        ).double().transpose(-1, -2)
        scores = torch.where((m[:, None] - m[None, :]) >= pairs.split, far, scores)
    scores = scores * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), -torch.inf)
    out = torch.softmax(scores, -1) @ value.repeat_interleave(groups, 1).double()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def reference_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def tiny(model_type: str, **extra):
    config = transformers.AutoConfig.for_model(
        model_type, **{**SMALL, **EXTRA.get(model_type, {}), **extra}
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def logits(model, attention: str, ids: torch.Tensor, pairs: Pairs | None = None) -> torch.Tensor:
    CAPTURED.clear()
    model.config._pairs = pairs
    model.set_attn_implementation(attention)
    return model(input_ids=ids, use_cache=False).logits.double()


@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_every_verified_type_runs_each_scheme_as_the_per_pair_reference(model_type, monkeypatch):
    """STRING, Self-Extend and ReRoPE on a tiny random model of the type equal the per-pair reference built on the
    model's own rotary function, which itself equals the model's eager attention without a scheme; each scheme
    moves the logits, so the comparison is not vacuous."""
    capture_rotary(model_type, monkeypatch)
    model = tiny(model_type)
    ids = torch.randint(
        3, SMALL["vocab_size"], (1, LENGTH), generator=torch.Generator().manual_seed(1)
    )
    eager = logits(model, "eager", ids)
    torch.testing.assert_close(logits(model, REFERENCE, ids), eager, atol=1e-5, rtol=0)
    for name, (options, pairs) in SCHEMES.items():
        apply_scheme(model, name, train_len=96, **options)
        ours = logits(model, model.config._attn_implementation, ids)
        reference = logits(model, REFERENCE, ids, pairs)
        assert (reference - eager).abs().max() > 1e-2, name
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_cached_decoding_equals_the_whole_sequence(model_type):
    """The last tokens fed one at a time over the KV cache (each scheme's decoding path, the NoPE layers' and the
    folded scaling's included) give the logits of one forward over the whole sequence, which the test above
    checks against the reference."""
    model = tiny(model_type)
    ids = torch.randint(
        3, SMALL["vocab_size"], (1, LENGTH), generator=torch.Generator().manual_seed(2)
    )
    steps = 3
    for name, (options, _) in SCHEMES.items():
        apply_scheme(model, name, train_len=96, **options)
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False).logits[0, -steps:]
            out = model(input_ids=ids[:, :-steps], use_cache=True)
            stepped = []
            for i in range(LENGTH - steps, LENGTH):
                cache = {cache_keyword(model): out.past_key_values}
                out = model(input_ids=ids[:, i : i + 1], use_cache=True, **cache)
                stepped.append(out.logits[0, -1])
        torch.testing.assert_close(torch.stack(stepped), whole, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize(
    "model_type,extra,match",
    [
        ("cohere", {}, "not 'cohere'"),  # interleaved rotary pairs
        ("phi3", {"rope_parameters": None}, "longrope"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
    ids=["unverified-type", "longrope", "dynamic"],
)
def test_what_the_schemes_cannot_model_is_refused_before_a_forward(model_type, extra, match):
    if model_type == "phi3":
        long = [float(i + 1) for i in range(8)]
        extra = {
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": long,
                "original_max_position_embeddings": 64,
            },
        }
    model = tiny(model_type, **extra)
    for name in ("string", "self_extend"):
        with pytest.raises(ValueError, match=match):
            apply_scheme(model, name, train_len=96)


def test_a_window_only_the_mask_shows_is_refused():
    """A sliding window or chunked attention that reaches the attention function only through its mask (PhiMoE's,
    Llama 4's chunks) is refused when the forward's layout is worked out; causal masks with left or right padding
    pass."""
    length, pad = 12, 3
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    block = torch.arange(length)
    left = causal & (block >= pad)[None, :]  # row 1's first 3 tokens are padding
    right = causal & (block < length - pad)[None, :]
    for rows in ((causal, left), (causal, right)):
        packed_layout(torch.stack(rows)[:, None], 2, length, length, torch.device("cpu"))
    windowed = causal & ~torch.ones(length, length, dtype=torch.bool).tril(-4)
    with pytest.raises(ValueError, match="hides keys a causal query would see"):
        packed_layout(
            torch.stack((causal, windowed))[:, None], 2, length, length, torch.device("cpu")
        )
    additive = torch.zeros(length, length).masked_fill(~causal, -torch.inf)  # 0 where a key is seen
    with pytest.raises(ValueError, match="a torch.float32 attention mask"):
        packed_layout(additive[None, None], 1, length, length, torch.device("cpu"))


def test_windows_a_config_declares_are_refused_before_a_forward():
    """In cached decoding a window that only the mask shows looks like left padding, so a config that declares
    windowed layers is refused when the scheme is applied."""
    for model_type, window in (
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)),
        (
            "mistral",
            dict(sliding_window=32),
        ),  # a window the layers name, refused before the weights load
    ):
        model = tiny(model_type, **window)
        for name in ("string", "self_extend"):
            with pytest.raises(ValueError, match="declares sliding-window or chunked layers"):
                apply_scheme(model, name, train_len=96)
    # layer_types decide where a config lists them: Qwen2-MoE windows no layer from max_window_layers on
    apply_scheme(
        tiny("qwen2_moe", use_sliding_window=True, sliding_window=32, max_window_layers=0),
        "string",
        train_len=96,
    )


def test_attention_sinks_are_refused():
    with pytest.raises(ValueError, match="attention sinks"):
        refuse_unsupported({"s_aux": torch.zeros(4)})
