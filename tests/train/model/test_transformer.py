"""The TinyLlama model: presets, per-document isolation, training step, cached generation."""

from __future__ import annotations

import pytest
import torch

from posfreq.train.model.config import PRESETS, ModelConfig, model_preset
from posfreq.train.model.transformer import Transformer, positions_in_sequences, row_groups


def small_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(
        model_preset("tiny-2l-128", vocab_size=97, **overrides), attention_backend="sdpa"
    )


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def test_tinyllama_preset_on_meta_device():
    config = PRESETS["tinyllama-1.3b"]
    assert (config.n_layers, config.d_model, config.ffn_dim, config.n_heads, config.n_kv_heads) == (
        22,
        2048,
        5632,
        32,
        4,
    )
    assert config.vocab_size == 128_256
    with torch.device("meta"):
        model = Transformer(config)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == config.num_params()
    # Independent count: 22 blocks of attention (q, o: d*d; k, v: d*256) + SwiGLU (3*d*f) + 2 norms.
    d, f = 2048, 5632
    block = 2 * d * d + 2 * d * 256 + 3 * d * f + 2 * d
    assert counted == 22 * block + d + 2 * 128_256 * d


def test_tied_embeddings_share_storage():
    model = small_model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()


def test_init_is_small_scale():
    model = small_model()
    d = model.config.d_model
    assert abs(model.embed_tokens.weight.std().item() - (2 / (5 * d)) ** 0.5) < 0.01
    # Loss at init is near ln(vocab), not the ~180 that N(0, 1) embeddings give.
    logits = model(torch.randint(0, 97, (2, 32)))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), torch.randint(0, 97, (64,)))
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 1.0


def test_positions_restart_per_document():
    assert positions_in_sequences(cu([3, 1, 2]), 6).tolist() == [0, 1, 2, 0, 0, 1]


def test_packed_equals_documents_run_separately():
    model = small_model()
    lens = [5, 17, 3, 40]
    ids = torch.randint(0, 97, (sum(lens),))
    packed = model(ids, cu(lens))
    bounds = cu(lens).tolist()
    separate = torch.cat([model(ids[a:b][None])[0] for a, b in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(packed, separate, atol=1e-4, rtol=1e-4)


def test_changing_one_document_leaves_others_untouched():
    model = small_model()
    lens = [10, 12]
    ids = torch.randint(0, 97, (22,))
    other = ids.clone()
    other[:10] = torch.randint(0, 97, (10,))
    a, b = model(ids, cu(lens)), model(other, cu(lens))
    assert torch.equal(a[10:], b[10:])
    assert not torch.allclose(a[:10], b[:10])


def test_forward_backward_updates_every_parameter():
    model = small_model()
    ids = torch.randint(0, 97, (64,))
    logits = model(ids[:-1], cu([30, 33]))
    torch.nn.functional.cross_entropy(logits, ids[1:]).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_generate_with_cache_equals_full_recompute():
    model = small_model(seed=3)
    prompts = torch.randint(0, 97, (3, 11))
    generated = model.generate(prompts, 9)
    seq = prompts.clone()
    for _ in range(9):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated == seq[:, 11:].tolist()


def test_generate_batched_equals_unbatched_and_stops():
    model = small_model(seed=4)
    prompts = torch.randint(0, 97, (4, 9))
    batched = model.generate(prompts, 6)
    single = [model.generate(prompts[i : i + 1], 6)[0] for i in range(4)]
    assert batched == single
    stopped = model.generate(prompts, 6, stop=lambda row, toks: len(toks) == 2)
    assert all(len(row) == 2 for row in stopped)


def test_prefill_in_row_groups_equals_full_recompute():
    """prefill_tokens forwards the prompts a few rows at a time into one shared cache (generate) or one forward per
    group (target_logprobs): the same greedy tokens and teacher-forced log-probabilities as full recomputes."""
    model = small_model(seed=6)
    prompts = torch.randint(0, 97, (5, 11))
    seq = prompts.clone()
    for _ in range(7):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = model(seq).log_softmax(-1)[:, 10:-1].gather(-1, seq[:, 11:, None])[..., 0]
    assert [(g.start, g.stop) for g in row_groups(5, 11, 22)] == [(0, 2), (2, 4), (4, 5)]
    for tokens in (1, 11, 22, 40, None):  # below one row, 1, 2 and 3 rows per group, all at once
        assert model.generate(prompts, 7, prefill_tokens=tokens) == seq[:, 11:].tolist()
        with torch.no_grad():
            logprobs, correct = model.target_logprobs(seq, 11, prefill_tokens=tokens)
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
        assert bool(correct.all())  # seq continues greedily, so every target is the argmax


def test_generate_with_a_bf16_prefill_decodes_in_float32():
    """prefill_dtype=bfloat16: the prompt's forward under bf16 autocast, then float32 steps over a float32 cache; equal
    to doing those two things by hand, and the cache is never bf16."""
    model = small_model(seed=5)
    prompts = torch.randint(0, 97, (2, 10))
    generated = model.generate(prompts, 5, prefill_dtype=torch.bfloat16)
    caches = model.new_caches(2, 15, torch.float32, prompts.device)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.hidden_states(prompts.reshape(-1), cu([10, 10]), 10, caches)
        assert caches[0].k.dtype == torch.float32
        ids = model.lm_head(hidden.view(2, 10, -1)[:, -1].float()).argmax(-1)
        expected = [ids]
        for _ in range(4):
            ids = model.lm_head(
                model.hidden_states(ids, cu([1, 1]), 1, caches, position_offset=caches[0].length)
            ).argmax(-1)
            expected.append(ids)
    assert generated == torch.stack(expected, 1).tolist()


def test_config_rejects_unknown_keys():
    try:
        ModelConfig.from_dict({"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "colour": "red"})
    except ValueError as err:
        assert "colour" in str(err)
    else:
        raise AssertionError("unknown key accepted")


def test_impossible_sizes_are_refused_before_anything_is_allocated():
    """A corrupt or hostile config (a 2^40 vocabulary asked for 562 TB) is a ValueError naming the field."""
    from posfreq.train.model.config import ModelConfig

    with pytest.raises(ValueError, match="vocab_size=1,099,511,627,776 does not fit"):
        ModelConfig(vocab_size=2**40)
    with pytest.raises(ValueError, match="parameters .* TiB in float32"):
        ModelConfig(vocab_size=2**31, d_model=8192)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "vocab_size": 2**40})
