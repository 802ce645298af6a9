"""Every position scheme as a transformers attention function (train/positions/hf_schemes.py).

- On Llama weights, each scheme through transformers equals posfreq's own model running the same scheme
  (`set_positions`): logits of a left-padded prefill, and of 32 cached decoding steps of `generate`, against
  posfreq's forward over the prompt and the generated tokens.
- On Qwen2 (q/k/v biases) and Mistral, string and self_extend agree with a per-pair float64 reference: every
  (query, key) pair un-rotated from its own position and scored with the query turned by the scheme's distance
  for that pair (`pair_distance`), nothing else of the scheme used.
- Mutants (an off-by-one far position, a far pass that is never merged) fail those comparisons.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf import SMALL_DECODER

transformers = pytest.importorskip("transformers")

from posfreq.train.model.hf import load_hf_model  # noqa: E402
from posfreq.train.positions import merge  # noqa: E402
from posfreq.train.positions import scheme as scheme_module  # noqa: E402
from posfreq.train.positions.hf_schemes import (  # noqa: E402
    CONFIG_KEY,
    apply_scheme,
    rotary_base,
    scheme_options,
)
from posfreq.train.positions.schemes import build_scheme  # noqa: E402
from posfreq.train.positions.string_hf import settings_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TRAIN_LEN = 48  # paper protocol: L' = 32, so every baseline rewrites distances from 8 to 24 on
PROMPTS = (40, 29)  # the second is left-padded by 11
STEPS = 32
SMALL = {**SMALL_DECODER, "max_position_embeddings": TRAIN_LEN}
BASELINES = ("rerope", "self_extend", "dca", "ntk", "yarn", "string")
REFERENCE = "posfreq_pair_reference"


def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and their attention mask."""
    torch.manual_seed(1)
    longest = max(PROMPTS)
    ids = torch.randint(3, vocab, (len(PROMPTS), longest))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPTS):
        ids[row, : longest - n] = 0
        mask[row, longest - n :] = 1
    return ids, mask


def generate(model, ids, mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy `generate` with the KV cache: the sequences and each step's logits (B, V)."""
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=STEPS,
        min_new_tokens=STEPS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, list(out.logits)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama (plain rope: ntk and yarn replace its frequencies) saved by transformers."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(directory)
    return directory


def hf_with(directory, name: str, **options):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    return apply_scheme(model.eval(), name, **options)


@pytest.mark.parametrize("name", BASELINES)
def test_each_scheme_through_transformers_equals_posfreqs_own_model(llama_dir, name) -> None:
    hf = hf_with(llama_dir, name)
    ours = load_hf_model(llama_dir).eval()
    ours.set_positions(name)
    assert ours.config.train_len == TRAIN_LEN  # the same defaults on both sides
    ids, mask = prompts(SMALL["vocab_size"])
    with torch.no_grad():
        prefill = hf(input_ids=ids, attention_mask=mask).logits
        sequences, steps = generate(hf, ids, mask)
        for row, n in enumerate(PROMPTS):
            real = sequences[row, max(PROMPTS) - n :]  # the prompt and what was generated
            reference = ours(real[None, :-1])[0]  # posfreq's prefill over all of it, no cache
            assert torch.allclose(prefill[row, max(PROMPTS) - n :], reference[:n], atol=1e-5), row
            decoded = torch.stack([step[row] for step in steps])
            assert torch.allclose(decoded, reference[n - 1 :], atol=1e-5), row
    assert len(steps) == STEPS and sequences.shape[1] == max(PROMPTS) + STEPS


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (..., D) rotated by `positions` (broadcasting against x's leading dimensions), in float64."""
    angles = positions[..., None].double() * inv_freq.double()
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reference_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Per pair: q and k back at position 0 (in float64), q turned by the scheme's distance for that pair."""
    config = module.config
    name = config._reference_scheme
    if name == "string":
        s = settings_of(config)
        pair = build_scheme(
            "string", rotary_base(config), TRAIN_LEN, shift=s.shift, window=s.window
        )
    else:
        stored = getattr(config, CONFIG_KEY)
        pair = build_scheme(name, rotary_base(config), stored["train_len"], **stored["options"])
    inv_freq = config._reference_inv_freq
    batch, heads, len_q, dim = query.shape
    len_k = key.shape[2]
    allowed = attention_mask.bool()[:, 0] if attention_mask is not None else None
    if allowed is None:
        allowed = torch.ones(batch, len_q, len_k, dtype=torch.bool).tril(len_k - len_q)
    pads = allowed[:, -1].float().argmax(-1)  # left padding: the last query's first visible key
    key_pos = torch.arange(len_k)[None] - pads[:, None]
    query_pos = key_pos[:, len_k - len_q :]
    groups = heads // key.shape[1]
    q = rotate(query, -query_pos[:, None, :], inv_freq)  # back at position 0, (B, H, Lq, D)
    k = rotate(key, -key_pos[:, None, :], inv_freq).repeat_interleave(groups, 1)
    m, n = query_pos[:, :, None].numpy(), key_pos[:, None, :].numpy()
    causal = (m >= n) & (m >= 0) & (n >= 0)
    seen = torch.from_numpy(np.where(causal, pair.pair_distance(m, np.minimum(n, m)), 0))
    turned = rotate(q[:, :, :, None, :], seen[:, None, :, :], inv_freq)  # (B, H, Lq, Lk, D)
    scores = (turned * k[:, :, None, :, :]).sum(-1) * (dim**-0.5 if scaling is None else scaling)
    keep = allowed & torch.from_numpy(causal)
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = probs @ value.repeat_interleave(groups, 1).double()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def reference_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def family(name: str):
    torch.manual_seed(0)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).eval()
    config = transformers.MistralConfig(**SMALL, sliding_window=None)
    return transformers.MistralForCausalLM(config).eval()


def scheme_and_reference(model_family: str, name: str) -> tuple[list, list]:
    """(prefill logits, step logits) of the scheme's function and of the per-pair reference, same model."""
    model = family(model_family)
    model.config._reference_inv_freq = model.model.rotary_emb.inv_freq.clone()
    model.config._reference_scheme = name
    ids, mask = prompts(SMALL["vocab_size"])
    results = []
    for implementation in ("scheme", REFERENCE):
        apply_scheme(model, name)
        if implementation == REFERENCE:
            model.set_attn_implementation(REFERENCE)
        with torch.no_grad():
            prefill = model(input_ids=ids, attention_mask=mask).logits
            _, steps = generate(model, ids, mask)
        results.append((prefill, steps))
    return results


def agree(ours, reference, mask) -> bool:
    (prefill, steps), (ref_prefill, ref_steps) = ours, reference
    real = mask.bool()
    return torch.allclose(prefill[real], ref_prefill[real], atol=1e-5) and all(
        torch.allclose(a, b, atol=1e-5) for a, b in zip(steps, ref_steps)
    )


@pytest.mark.parametrize("model_family", ["qwen2", "mistral"])
@pytest.mark.parametrize("name", ["string", "self_extend"])
def test_qwen2_and_mistral_agree_with_a_per_pair_reference(model_family, name) -> None:
    ours, reference = scheme_and_reference(model_family, name)
    _, mask = prompts(SMALL["vocab_size"])
    assert agree(ours, reference, mask)


def test_an_off_by_one_far_position_fails(monkeypatch) -> None:
    real = scheme_module.SelfExtendScheme.far_query_positions
    monkeypatch.setattr(
        scheme_module.SelfExtendScheme, "far_query_positions", lambda self, p: real(self, p) + 1
    )
    ours, reference = scheme_and_reference("qwen2", "self_extend")
    assert not agree(ours, reference, prompts(SMALL["vocab_size"])[1])


def test_a_far_pass_never_merged_fails(monkeypatch) -> None:
    monkeypatch.setattr(scheme_module, "merge_into", lambda *args, **kwargs: None)
    assert merge.merge_into is not scheme_module.merge_into
    ours, reference = scheme_and_reference("mistral", "self_extend")
    assert not agree(ours, reference, prompts(SMALL["vocab_size"])[1])


def test_options_are_resolved_and_bad_ones_refused_before_any_forward(llama_dir) -> None:
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    options = scheme_options(config, "self_extend", TRAIN_LEN)
    assert options == {"group": 2, "window": 8, "protocol": "paper", "scale": 1.5}
    assert scheme_options(config, "string", TRAIN_LEN) == {"shift": 16, "window": 8}
    with pytest.raises(ValueError, match="does not take"):
        scheme_options(config, "dca", TRAIN_LEN, shift=3)
    with pytest.raises(ValueError, match="shift and window"):
        scheme_options(config, "string", TRAIN_LEN, group=3)
    model = hf_with(llama_dir, "rerope", window=5)
    assert getattr(model.config, CONFIG_KEY)["options"] == {"window": 5}


def test_what_the_schemes_do_not_model_is_refused(llama_dir) -> None:
    """A partial rotary embedding is refused when the scheme is applied; a static cache (slots after the newest
    query) at the first forward, never computed wrongly."""
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        scheme_options(config, "dca", TRAIN_LEN)
    hf = hf_with(llama_dir, "self_extend")
    ids, mask = prompts(SMALL["vocab_size"])
    with pytest.raises(ValueError, match="static cache"), torch.no_grad():
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
        )


def test_ntk_and_yarn_set_the_rotary_embedding_and_another_scheme_restores_it(llama_dir) -> None:
    """ntk and yarn run as the model's own rotary embedding with the scheme's frequencies (transformers' sdpa
    attention); applying any other scheme afterwards gives the model's own frequencies back."""
    ids, mask = prompts(SMALL["vocab_size"])
    plain = hf_with(llama_dir, "rope")
    model = hf_with(llama_dir, "yarn")
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        reference = plain(input_ids=ids, attention_mask=mask).logits
        scaled = model(input_ids=ids, attention_mask=mask).logits
        apply_scheme(model, "ntk")
        apply_scheme(model, "rope")
        restored = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(scaled, reference, atol=1e-3)
    assert torch.equal(restored, reference)


def test_rope_is_the_models_own_attention_on_any_decoder(tmp_path) -> None:
    """rope asks nothing of posfreq's schemes, so it runs on decoders the schemes refuse: a yarn-scaled rotary,
    rope parameters per layer type (Gemma 3), no rotary at all (GPT-2) and a model transformers runs only eagerly
    (Gemma 2): load_causal_lm's model gives the logits of transformers' own, loaded without posfreq."""
    from posfreq.train.positions.hf_schemes import load_causal_lm

    tiny = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    decoders = {
        "yarn": transformers.LlamaConfig(
            **tiny,
            **heads,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 16,
            },
        ),
        "gemma3": transformers.Gemma3TextConfig(
            **tiny, **heads, sliding_window=8, max_position_embeddings=64
        ),
        "gpt2": transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=1,
        ),
        "gemma2": transformers.Gemma2Config(
            **tiny, **heads, sliding_window=8, max_position_embeddings=64
        ),
    }
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (2, 40))
    for name, config in decoders.items():
        directory = tmp_path / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        with pytest.raises(ValueError):  # what the schemes refuse for each of them
            scheme_options(transformers.AutoConfig.from_pretrained(directory), "dca", 32)
        own = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        ours = load_causal_lm(directory, "rope")
        with torch.no_grad():
            expected, got = own(input_ids=ids).logits, ours(input_ids=ids).logits
        assert torch.equal(got, expected), name
        assert ours.config._attn_implementation == own.config._attn_implementation, name
    with pytest.raises(ValueError, match="rope does not take"):
        load_causal_lm(tmp_path / "gpt2", "rope", window=3)
