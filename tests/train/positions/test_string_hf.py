"""STRING as a transformers attention function, against a per-pair reference: every (query, key) pair
un-rotated from its own position and scored with q rotated explicitly by STRING's distance, on tiny
random Llama (llama3 rope scaling), Qwen2 (q/k/v biases) and Mistral models, batched with left padding,
in prefill and over 32 cached decoding steps of `generate`."""

from __future__ import annotations

import pytest
import torch
from helpers.hf import SMALL_DECODER

transformers = pytest.importorskip("transformers")

from posfreq.train.positions import string_hf  # noqa: E402
from posfreq.train.positions.string_hf import (  # noqa: E402
    STRING_ATTENTION,
    apply_string,
    rope_inv_freq,
    settings_of,
)

REFERENCE = "posfreq_string_reference"
TRAIN_LEN = 48  # S = 16, W = 8: prompts of 40 tokens reach far into the shifted distances
PROMPTS = (40, 29)  # the second is left-padded by 11
SMALL = {**SMALL_DECODER, "max_position_embeddings": TRAIN_LEN}


def llama():
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, rope_parameters=rope))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None))


FAMILIES = {"llama": llama, "qwen2": qwen2, "mistral": mistral}


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) rotated back from `positions` (B, L), in float64."""
    angles = -positions[:, None, :, None].double() * inv_freq.double()  # (B, 1, L, D/2)
    cos, sin = (
        torch.cat((angles.cos(), angles.cos()), -1),
        torch.cat((angles.sin(), angles.sin()), -1),
    )
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reference_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Per pair: q and k back at position 0, then q turned by STRING's distance for that pair alone."""
    settings = settings_of(module.config)
    inv_freq = module.config._reference_inv_freq  # the model's own rotary embedding's
    batch, heads, len_q, dim = query.shape
    len_k = key.shape[2]
    allowed = attention_mask.bool()[:, 0] if attention_mask is not None else None
    if allowed is None:
        allowed = torch.ones(batch, len_q, len_k, dtype=torch.bool).tril(len_k - len_q)
    pads = allowed[:, -1].float().argmax(-1)  # left padding: the last query's first visible key
    key_pos = torch.arange(len_k)[None] - pads[:, None]
    query_pos = key_pos[:, len_k - len_q :]
    groups = heads // key.shape[1]
    q = unrotate(query, query_pos, inv_freq)
    k = unrotate(key.repeat_interleave(groups, 1), key_pos, inv_freq)
    d = query_pos[:, :, None] - key_pos[:, None, :]  # (B, Lq, Lk)
    seen = torch.where(d < settings.shift, d, d - settings.shift + settings.window)
    angles = seen[:, None, :, :, None].double() * inv_freq.double()  # (B, 1, Lq, Lk, D/2)
    cos, sin = (
        torch.cat((angles.cos(), angles.cos()), -1),
        torch.cat((angles.sin(), angles.sin()), -1),
    )
    half = dim // 2
    qq = q[:, :, :, None, :]
    turned = qq * cos + torch.cat((-qq[..., half:], qq[..., :half]), dim=-1) * sin
    scores = (turned * k[:, :, None, :, :]).sum(-1) * (dim**-0.5 if scaling is None else scaling)
    scores = scores.masked_fill(~(allowed & (d >= 0))[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = probs @ value.repeat_interleave(groups, 1).double()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def reference_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def batch_of_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and their attention mask."""
    torch.manual_seed(1)
    longest = max(PROMPTS)
    ids = torch.randint(3, vocab, (len(PROMPTS), longest))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPTS):
        ids[row, : longest - n] = 0
        mask[row, longest - n :] = 1
    return ids, mask


def model_of(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    model.config._reference_inv_freq = model.model.rotary_emb.inv_freq.clone()
    return apply_string(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_frequencies_are_the_models_own(family):
    model = model_of(family)
    torch.testing.assert_close(rope_inv_freq(model.config), model.model.rotary_emb.inv_freq)
    assert settings_of(model.config) == string_hf.StringSettings(TRAIN_LEN // 3, 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_equals_the_per_pair_reference_with_left_padding(family):
    model = model_of(family)
    ids, mask = batch_of_prompts(model.config.vocab_size)
    with torch.no_grad():
        string = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(REFERENCE)
        reference = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        rope = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(string[real], reference[real], rtol=0, atol=1e-5)
    assert not torch.allclose(string[real], rope[real], atol=1e-3)  # the far distances did change


def test_under_bf16_autocast_one_dtype_reaches_the_backend_and_agrees_with_float32(monkeypatch):
    """The probe's precision on a GPU: float32 weights under bf16 autocast. transformers rotates q and k in
    float32 while v comes out of an autocast projection; STRING must hand the backend choice one dtype (bf16,
    so a GPU takes FlashAttention, not a dense float32 path) and agree with float32 within bf16 rounding."""
    import posfreq.train.model.attention as attention

    model = model_of("llama")
    ids, mask = batch_of_prompts(model.config.vocab_size)
    seen = []
    real_resolve = attention.resolve_backend

    def resolve(backend, device, dtype, **call):
        seen.append(dtype)
        return real_resolve(backend, device, dtype, **call)

    monkeypatch.setattr(attention, "resolve_backend", resolve)
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask).logits
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(input_ids=ids, attention_mask=mask).logits
    assert seen and set(seen) == {torch.bfloat16}, seen
    real = mask.bool()
    scale = exact[real].abs().max()
    assert (mixed[real].float() - exact[real]).abs().max() < 0.05 * scale


def test_right_padding_for_scoring_and_a_scattered_mask_is_refused():
    """Scoring pads on the right (lm-eval's log-likelihoods); a mask with holes is refused by name."""
    model = model_of("llama")
    ids, left = batch_of_prompts(model.config.vocab_size)
    right = left.flip(1)
    ids = torch.stack([torch.cat((row[m.bool()], row[~m.bool()])) for row, m in zip(ids, left)])
    with torch.no_grad():
        string = model(input_ids=ids, attention_mask=right).logits
        model.set_attn_implementation(REFERENCE)
        reference = model(input_ids=ids, attention_mask=right).logits
        model.set_attn_implementation(STRING_ATTENTION)
        holes = right.clone()
        holes[0, 5] = 0
        with pytest.raises(ValueError, match="one contiguous block"):
            model(input_ids=ids, attention_mask=holes)
    real = right.bool()
    torch.testing.assert_close(string[real], reference[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generate_equals_the_reference_on_the_whole_sequence(family):
    """32 greedy steps of `generate` with a KV cache: each step's logits equal the reference's at that
    position of the finished sequence, recomputed without a cache."""
    model = model_of(family)
    ids, mask = batch_of_prompts(model.config.vocab_size)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        full_mask = torch.cat((mask, torch.ones(len(PROMPTS), 32, dtype=mask.dtype)), dim=1)
        model.set_attn_implementation(REFERENCE)
        reference = model(input_ids=out.sequences, attention_mask=full_mask).logits
    steps = torch.stack(out.logits, dim=1)  # (B, 32, V)
    start = ids.shape[1] - 1
    torch.testing.assert_close(steps, reference[:, start : start + 32], rtol=0, atol=1e-5)


def test_llama_equals_posfreqs_own_model_with_string(tmp_path):
    """The same weights through posfreq's importer and its own STRING scheme (default rope: the importer's)."""
    from posfreq.train.model.hf import load_hf_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    model.save_pretrained(tmp_path)
    ours = load_hf_model(tmp_path, dtype=torch.float32).eval()
    settings = settings_of(apply_string(model).config)
    ours.set_positions("string", shift=settings.shift, window=settings.window)
    ids = torch.randint(3, SMALL["vocab_size"], (1, 40))
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        mine = ours(ids)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_the_attention_implementation_loads_by_name(tmp_path):
    """from_pretrained(..., attn_implementation="posfreq_string") equals apply_string on a loaded model."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(tmp_path)
    auto = transformers.AutoModelForCausalLM
    by_name = auto.from_pretrained(tmp_path, attn_implementation=STRING_ATTENTION).eval()
    applied = apply_string(auto.from_pretrained(tmp_path).eval())
    plain = auto.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, SMALL["vocab_size"], (1, 40))
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (by_name, applied, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert not torch.allclose(logits[0], logits[2], atol=1e-3)
