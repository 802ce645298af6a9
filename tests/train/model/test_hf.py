"""Hugging Face import/export against transformers itself: tiny random Llama/Mistral models built locally."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.hf import consolidated_bytes_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from posfreq.train.model.config import ModelConfig  # noqa: E402
from posfreq.train.model.hf import export_hf, load_hf_model, tokenizer_spec  # noqa: E402
from posfreq.train.model.transformer import Transformer  # noqa: E402
from posfreq.train.positions.rotary import rotary_inv_freq, scaled_inv_freq  # noqa: E402

# head_dim 16 with base 10,000 and original length 256: rotary wavelengths 6 .. 19,869 fall in all three
# of llama3's bands (kept, interpolated, divided by factor).
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
TINY = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
)


def _save_llama(directory: Path, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny random LlamaForCausalLM saved to `directory` (fp32, weights large enough for clear argmaxes)."""
    shard = overrides.pop("shard", False)
    torch.manual_seed(seed)
    # copies: transformers writes rope_theta into a rope dict it is given (the module's LLAMA3_SCALING)
    settings = {k: dict(v) if isinstance(v, dict) else v for k, v in {**TINY, **overrides}.items()}
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(directory, **({"max_shard_size": "40KB"} if shard else {}))
    return model


def _ids(batch: int = 2, length: int = 24, vocab: int = 101) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def _assert_same_logits(ours: Transformer, hf, ids: torch.Tensor) -> None:
    with torch.no_grad():
        expected = hf(ids).logits
        actual = ours(ids)
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False},
        {"tie_word_embeddings": True},
        {"rope_scaling": LLAMA3_SCALING, "rope_theta": 10_000.0},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ],
    ids=["untied", "tied", "llama3-scaling", "linear-scaling"],
)
def test_import_matches_transformers_logits_and_greedy(tmp_path: Path, overrides: dict) -> None:
    hf = _save_llama(tmp_path, **overrides)
    ours = load_hf_model(tmp_path)
    assert ours.config.tie_embeddings == hf.config.tie_word_embeddings
    if ours.config.tie_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = _ids()
    _assert_same_logits(ours, hf, ids)
    prompt = ids[:, :8]
    with torch.no_grad():
        expected = hf.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours.generate(prompt, max_new_tokens=12) == expected[:, 8:].tolist()


def test_llama3_scaling_positions_beyond_original_length(tmp_path: Path) -> None:
    """Positions past original_max_position_embeddings are where llama3 scaling matters."""
    hf = _save_llama(tmp_path, rope_scaling=LLAMA3_SCALING)
    _assert_same_logits(load_hf_model(tmp_path), hf, _ids(batch=1, length=400))


def test_position_schemes_keep_the_checkpoint_rope_scaling(tmp_path: Path) -> None:
    """STRING on an input shorter than its shift is plain RoPE, so it must still match transformers."""
    hf = _save_llama(tmp_path, rope_scaling=LLAMA3_SCALING)
    ours = load_hf_model(tmp_path)
    ours.set_positions("string", shift=300, window=16)
    _assert_same_logits(ours, hf, _ids(batch=1, length=280))
    with pytest.raises(ValueError, match="rope_scaling"):
        ours.set_positions("ntk")


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_scaled_inv_freq_matches_transformers(scaling: dict) -> None:
    """Llama-3.1-8B's real rope parameters (head_dim 128, theta 500,000) against transformers' own function."""
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500_000.0,
        rope_scaling=scaling,
        max_position_embeddings=131_072,
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert attention_factor == 1.0
    actual = scaled_inv_freq(rotary_inv_freq(128, 500_000.0), scaling)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)


def test_sharded_import(tmp_path: Path) -> None:
    hf = _save_llama(tmp_path, shard=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_same_logits(load_hf_model(tmp_path), hf, _ids())


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd", 7]
)
def test_sharded_index_naming_a_file_outside_the_directory_is_refused(tmp_path: Path, name) -> None:
    model = tmp_path / "model"
    _save_llama(model, shard=True)
    index_file = model / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copyfile(
        model / first, tmp_path / "outside.safetensors"
    )  # a valid file, were it ever read
    index["weight_map"] = {
        key: name if value == first else value for key, value in index["weight_map"].items()
    }
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(index_file))}: file name {re.escape(repr(name))} "
        rf"points outside {re.escape(str(model))}",
    ):
        load_hf_model(model)


def test_sharded_index_naming_a_file_through_a_link_out_of_the_directory_is_refused(
    tmp_path: Path,
) -> None:
    """`sub/w.safetensors` with `sub` a symbolic link to another folder: a plain relative name that leads out."""
    model = tmp_path / "model"
    _save_llama(model, shard=True)
    index_file = model / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(model / first, elsewhere / "w.safetensors")  # a valid file, were it ever read
    (model / "sub").symlink_to(elsewhere, target_is_directory=True)
    index["weight_map"] = {
        key: "sub/w.safetensors" if value == first else value
        for key, value in index["weight_map"].items()
    }
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'sub/w.safetensors' leads outside .* symbolic link"):
        load_hf_model(model)


def test_mistral_without_sliding_window(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**TINY, sliding_window=None)).eval()
    hf.save_pretrained(tmp_path)
    _assert_same_logits(load_hf_model(tmp_path), hf, _ids())


def test_bf16_import(tmp_path: Path) -> None:
    hf = _save_llama(tmp_path)
    ours = load_hf_model(tmp_path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = _ids()
    with torch.no_grad():
        scale = hf(ids).logits.abs().max()
        torch.testing.assert_close(
            ours(ids).float(), hf(ids).logits, atol=0.05 * float(scale), rtol=0.05
        )


@pytest.mark.parametrize("tie", [False, True])
def test_export_reloads_in_transformers(tmp_path: Path, tie: bool) -> None:
    config = ModelConfig(
        vocab_size=101,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        train_len=512,
        tie_embeddings=tie,
        rope_scaling=LLAMA3_SCALING if tie else None,
    )
    torch.manual_seed(0)
    ours = Transformer(config).eval()
    export_hf(ours, tmp_path, bos_token_id=1, eos_token_id=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = _ids(batch=2, length=300)
    _assert_same_logits(ours, hf, ids)
    reloaded = load_hf_model(tmp_path)
    assert reloaded.config == config
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0)


def test_export_script_roundtrip(tmp_path: Path) -> None:
    """scripts/export_hf.py on a consolidated model directory: weights, config and dtype survive a reload."""
    from posfreq.scripts.commands import export_hf as script

    ours = consolidated_bytes_model(tmp_path / "ckpt")
    assert (
        script.main(
            [
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "hf"),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    out = tmp_path / "hf"
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["torch_dtype"]) == (
        256,
        257,
        "bfloat16",
    )
    reloaded = load_hf_model(out)
    assert reloaded.lm_head.weight is reloaded.embed_tokens.weight
    torch.testing.assert_close(
        reloaded.embed_tokens.weight, ours.embed_tokens.weight.bfloat16(), atol=0, rtol=0
    )
    assert tokenizer_spec(out) == f"hf:{out}"


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_non_llama_architecture_is_refused(tmp_path: Path) -> None:
    transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_model(tmp_path)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "dynamic",
        ),
        (
            {
                "rope_parameters": None,
                "rope_theta": 1e4,
                "rope_scaling": {"type": "yarn", "factor": 2.0},
            },
            "yarn",
        ),
        ({"head_dim": 8}, "head_dim"),
        (
            {
                "model_type": "mistral",
                "architectures": ["MistralForCausalLM"],
                "sliding_window": 16,
            },
            "sliding_window",
        ),
        # a window as long as the training length still applies to every longer probe length and answer token
        (
            {
                "model_type": "mistral",
                "architectures": ["MistralForCausalLM"],
                "sliding_window": TINY["max_position_embeddings"],
            },
            "sliding_window",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor=0.5",
        ),
    ],
)
def test_unsupported_field_is_refused(tmp_path: Path, changes: dict, named: str) -> None:
    _save_llama(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=named):
        load_hf_model(tmp_path)


def test_a_tied_head_stored_with_other_weights_is_refused(tmp_path: Path) -> None:
    """tie_word_embeddings with a stored lm_head.weight that differs: transformers 5 keeps the stored head, older
    releases the embeddings; refused rather than picking one. A stored head equal to the embeddings loads."""
    from safetensors.torch import load_file, save_file

    hf = _save_llama(tmp_path, tie_word_embeddings=True)
    weights = load_file(str(tmp_path / "model.safetensors"))
    embeddings = weights["model.embed_tokens.weight"]
    save_file(
        {**weights, "lm_head.weight": embeddings.clone()}, str(tmp_path / "model.safetensors")
    )
    _assert_same_logits(load_hf_model(tmp_path), hf, _ids())
    save_file({**weights, "lm_head.weight": embeddings * 2}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="stores a different lm_head.weight"):
        load_hf_model(tmp_path)
    # only the head stored: transformers ties the embeddings to it
    only_head = {k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}
    save_file({**only_head, "lm_head.weight": embeddings}, str(tmp_path / "model.safetensors"))
    _assert_same_logits(load_hf_model(tmp_path), hf, _ids())


LLAMA3_WITHOUT_LENGTH = {
    k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"
}


@pytest.mark.parametrize(
    "changes",
    [
        {"hidden_act": "swish"},  # transformers' other name for silu
        # the llama3 scaling's original length given only at the top level, as transformers reads it
        {
            "rope_parameters": {**LLAMA3_WITHOUT_LENGTH, "rope_theta": 1e4},
            "original_max_position_embeddings": 128,
        },
        # ... or nowhere: transformers takes max_position_embeddings
        {"rope_parameters": {**LLAMA3_WITHOUT_LENGTH, "rope_theta": 1e4}},
        # the top-level original length overrides the rope dict's
        {
            "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 1e4},
            "original_max_position_embeddings": 128,
        },
        # a rope_scaling added by hand wins over the rope_parameters transformers 5 saved, its theta too
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 5e5},
        {
            "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 5e5},
            "rope_scaling": {"rope_type": "default"},
        },
        {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 5e5}, "rope_scaling": LLAMA3_SCALING},
    ],
    ids=[
        "swish",
        "top-level-original-length",
        "no-original-length",
        "top-level-original-length-wins",
        "rope-scaling-wins",
        "default-rope-scaling-wins",
        "rope-scaling-theta-from-top-level",
    ],
)
def test_config_spellings_transformers_reads_alike_load_alike(
    tmp_path: Path, changes: dict
) -> None:
    """Each config.json as transformers 5 reads it (modeling_rope_utils: rope_scaling wins over rope_parameters,
    theta from the chosen dict or the top level, the original length from the top level first): the same
    logits from posfreq's import, past the original length."""
    _save_llama(tmp_path)
    _edit_config(tmp_path, **changes)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_same_logits(load_hf_model(tmp_path), hf, _ids(length=300))


def test_metadata_keys_pass_silently_and_unknown_ones_are_named(tmp_path: Path) -> None:
    """What a GGUF conversion writes (`_model_name_or_path`, `unk_token_id`) names things only: no warning; a key
    posfreq does not know might change the model, so it is named."""
    import warnings

    _save_llama(tmp_path)
    _edit_config(tmp_path, _model_name_or_path="smol", unk_token_id=0, sep_token_id=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_model(tmp_path)
    _edit_config(tmp_path, attn_logit_softcapping=30.0)
    with pytest.warns(UserWarning, match=r"ignoring config keys \['attn_logit_softcapping'\]"):
        load_hf_model(tmp_path)


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    _save_llama(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        load_hf_model(tmp_path)


def test_tokenizer_spec(tmp_path: Path) -> None:
    assert tokenizer_spec(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_spec(tmp_path) == f"hf:{tmp_path}"


def test_no_q_k_permutation_needed() -> None:
    """Our rotary equals transformers' apply_rotary_pos_emb (half-split layout), so q/k weights copy as is."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from posfreq.train.positions.rotary import Rotary

    head_dim, positions = 16, torch.arange(7)
    inv_freq = rotary_inv_freq(head_dim, 10_000.0)
    x = torch.randn(7, 3, head_dim)
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    expected, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    rotary = Rotary(inv_freq)
    torch.testing.assert_close(rotary.rotate(x, positions), expected[0].transpose(0, 1))
    assert math.isclose(float(inv_freq[1]), 10_000.0 ** (-2 / head_dim), rel_tol=1e-6)
    # cos/sin are kept for the last positions tensor only: other positions, or another dtype, are computed afresh
    shifted = positions + 5
    torch.testing.assert_close(rotary.rotate(x, shifted), Rotary(inv_freq).rotate(x, shifted))
    assert rotary.rotate(x.double(), shifted).dtype == torch.float64
    torch.testing.assert_close(rotary.rotate(x, positions), expected[0].transpose(0, 1))
    scaled = dataclasses.replace(
        rotary, scale=2.0
    )  # a copy with another scale does not inherit the kept cos/sin
    torch.testing.assert_close(
        scaled.rotate(x, positions), Rotary(inv_freq, 2.0).rotate(x, positions)
    )


def test_export_never_writes_into_another_model_and_drops_its_own_stale_weights(
    tmp_path: Path,
) -> None:
    from posfreq.scripts.commands import export_hf as export_script
    from posfreq.train.journal import record_written
    from posfreq.train.outdir import OutputDirError

    sharded = tmp_path / "downloaded"
    _save_llama(sharded, shard=True)
    before = {p.name: p.read_bytes() for p in sharded.iterdir()}
    ours = load_hf_model(sharded)
    with pytest.raises(OutputDirError, match="holds files `posfreq export-hf` did not write"):
        export_hf(ours, sharded)
    with pytest.raises(SystemExit, match="error: --out .*downloaded holds files"):
        export_script.main(
            ["--checkpoint", str(sharded), "--out", str(sharded), "--tokenizer", "none"]
        )
    assert {p.name: p.read_bytes() for p in sharded.iterdir()} == before
    out = tmp_path / "exported"
    export_hf(ours, out)
    stale = (
        out / "model-00001-of-00002.safetensors"
    )  # as an earlier, sharded export wrote it: in the journal
    record_written(stale)
    stale.write_bytes(b"stale")
    export_hf(ours, out)
    assert not stale.exists()  # an earlier export's weights would be loaded instead: gone
    mine = (
        out / "model-00002-of-00002.safetensors"
    )  # not in the journal: a user's, refused and kept
    mine.write_bytes(b"mine")
    with pytest.raises(OutputDirError, match=r"did not write \(model-00002-of-00002.safetensors"):
        export_hf(ours, out)
    assert mine.read_bytes() == b"mine"
    mine.unlink()
    _assert_same_logits(load_hf_model(out), LlamaForCausalLM.from_pretrained(sharded), _ids())


def test_fingerprint_covers_weight_files_in_sub_folders(tmp_path: Path) -> None:
    """A sharded model whose index names files in a sub-folder: changing one changes the fingerprint."""
    from posfreq.train.model.hf import hf_model_fingerprint

    _save_llama(tmp_path, shard=True)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    (tmp_path / "shards").mkdir()
    for name in set(index["weight_map"].values()):
        (tmp_path / name).rename(tmp_path / "shards" / name)
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    before = hf_model_fingerprint(tmp_path)
    shard = sorted((tmp_path / "shards").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert hf_model_fingerprint(tmp_path) != before
