"""`posfreq probe --engine transformers`: the same tests, scoring and records through transformers. On a
Llama-family model both engines give the same greedy answers; a Qwen2 model, which posfreq's importer
refuses, is probed end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.hf import TINY_HF, consolidated_bytes_model, save_tiny_hf

transformers = pytest.importorskip("transformers")

from posfreq.analysis.niah import store  # noqa: E402
from posfreq.analysis.niah.settings import ProbeSettings  # noqa: E402
from posfreq.scripts.commands import probe  # noqa: E402
from posfreq.train.model.config import ModelConfig  # noqa: E402

LENGTHS = [448, 768]  # S = 256 at L = 768: both lengths reach STRING's shifted distances


def exported_llama(root: Path) -> Path:
    """A tiny random posfreq model with the bytes tokenizer, exported as a Hugging Face Llama directory."""
    from posfreq.scripts.commands import export_hf

    config = ModelConfig(
        vocab_size=258, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, train_len=768
    )
    checkpoint = root / "checkpoint"
    consolidated_bytes_model(checkpoint, config, weight_std=0.3)
    export_hf.main(["--checkpoint", str(checkpoint), "--out", str(root / "hf")])
    return root / "hf"


def probe_records(model: str, out: Path, *flags: str) -> dict[tuple[int, int], dict]:
    args = ["--model", model, "--lengths", ",".join(map(str, LENGTHS)), "--tests-per-length", "4"]
    args += ["--haystack", "noise", "--max-new-tokens", "40", "--out", str(out), "--quiet"]
    assert probe.main([*args, "--no-figures", *flags]) == 0
    return {(r["length"], r["index"]): r for r in store.read_records(out, LENGTHS)}


@pytest.mark.slow  # four probes end to end
@pytest.mark.parametrize("positions", ["rope", "string", "dca"])
def test_both_engines_give_the_same_answers_on_a_llama_model(tmp_path, positions):
    model = f"hf:{exported_llama(tmp_path)}"
    ours = probe_records(model, tmp_path / "posfreq", "--positions", positions)
    theirs = probe_records(  # a row per forward (--prefill-tokens), where posfreq's takes four
        model,
        tmp_path / "transformers",
        *("--positions", positions, "--engine", "transformers", "--prefill-tokens", "800"),
    )
    assert ours.keys() == theirs.keys() and len(ours) == 8
    for test, record in ours.items():
        assert theirs[test]["generated"] == record["generated"], test
        assert theirs[test]["needles"] == record["needles"]
        for a, b in zip(theirs[test]["tf_logprob"], record["tf_logprob"]):
            assert a == pytest.approx(b, abs=1e-3)
    keys = {
        json.loads((tmp_path / d / "key.json").read_text())["key"]
        for d in ("posfreq", "transformers")
    }
    assert len(keys) == 2  # the engine is part of the result key


@pytest.mark.slow  # a probe end to end
def test_a_qwen2_model_is_probed_end_to_end(tmp_path):
    save_tiny_hf(
        tmp_path / "qwen2",
        "qwen2",
        tokenizer=False,  # --tokenizer bytes
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = f"hf:{tmp_path / 'qwen2'}"
    with pytest.raises(
        SystemExit, match="Fix: --engine transformers"
    ):  # posfreq's importer: Llama only
        probe_records(model, tmp_path / "refused", "--tokenizer", "bytes")
    records = probe_records(
        model,
        tmp_path / "out",
        "--tokenizer",
        "bytes",
        "--engine",
        "transformers",
        "--positions",
        "string",
    )
    assert len(records) == 8 and all(
        "passed" in r or "hits_anywhere" in r for r in records.values()
    )
    assert (tmp_path / "out" / "effective_length.csv").is_file()


def test_the_transformers_engine_refuses_what_it_cannot_run():
    ProbeSettings(engine="transformers", positions="dca")  # every scheme runs there
    with pytest.raises(ValueError, match="one dtype from prefill to decoding"):
        ProbeSettings(engine="transformers", precision="bfloat16-prefill")
    assert "engine" not in ProbeSettings().decoding()  # keys of the default engine are unchanged


def test_teacher_forcing_scores_only_the_answer_positions_as_a_full_forward_would():
    from posfreq.analysis.niah.hf_engine import TransformersGenerator

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF)).eval()
    ids = torch.randint(0, 258, (3, 40))
    with torch.no_grad():
        full = model(input_ids=ids).logits.log_softmax(-1)  # every position's logits, the plain way
    reference = full[:, 29:-1].gather(-1, ids[:, 30:, None])[..., 0]
    logprobs, hits = TransformersGenerator(model).target_logprobs(ids, 30, prefill_tokens=80)
    torch.testing.assert_close(logprobs, reference, rtol=0, atol=1e-5)
    assert torch.equal(hits, full[:, 29:-1].argmax(-1) == ids[:, 30:])


@pytest.mark.parametrize("positions", ["rope", "string"])
def test_continuations_on_the_prompts_cache_score_as_full_forwards_would(positions):
    """Each continuation scored on the prompts' cache (cut back after each, in row groups) equals the full forward of
    prompt + continuation, for transformers' own attention and for STRING's (S = 16 < the prompt)."""
    from posfreq.analysis.niah.hf_engine import TransformersGenerator
    from posfreq.train.positions.hf_schemes import apply_scheme

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF)).eval()
    if positions == "string":
        apply_scheme(model, "string", 64, shift=16)
    prompt = torch.randint(0, 258, (3, 30))
    continuations = [torch.randint(0, 258, (3, width)) for width in (4, 1, 6)]
    scored = TransformersGenerator(model).continuation_logprobs(
        prompt, continuations, prefill_tokens=60
    )
    for tokens, (logprobs, hits) in zip(continuations, scored):
        whole = torch.cat((prompt, tokens), dim=1)
        with torch.no_grad():
            full = model(input_ids=whole).logits.log_softmax(-1)[:, 29:-1]
        torch.testing.assert_close(
            logprobs, full.gather(-1, tokens[..., None])[..., 0], rtol=0, atol=1e-4
        )
        assert torch.equal(hits, full.argmax(-1) == tokens)


def test_an_architecture_the_schemes_are_not_checked_on_is_refused_before_its_weights_load(
    tmp_path, monkeypatch
):
    """A Cohere model (interleaved rotary pairs, on which STRING's extra rotation would be silently wrong) is
    refused from its config alone, before any weight is read, naming the type and one fix."""
    from posfreq.analysis.niah import hf_engine
    from posfreq.analysis.niah.settings import ProbeError

    config = transformers.CohereConfig(**{**TINY_HF, "num_hidden_layers": 1})
    transformers.CohereForCausalLM(config).save_pretrained(tmp_path)
    loaded = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a)
    )
    settings = ProbeSettings(engine="transformers", positions="string")
    with pytest.raises(ProbeError, match="not 'cohere'") as refused:
        hf_engine.load_transformers_model(tmp_path, settings, torch.device("cpu"), 768)
    assert str(refused.value).count("Fix:") == 1 and not loaded
