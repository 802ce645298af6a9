"""Model sources and their prompts: BOS and chat templates, hostile templates, fingerprints by content."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers.probe import hf_source_for, tiny_model, write_chat_tokenizer, write_checkpoint

from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah import sources as probe_sources
from posfreq.analysis.niah.needles import ANSWER_PREFIX, INSTRUCTION, QUESTION
from posfreq.scripts.commands import probe
from posfreq.train.data.tokenizer import get_tokenizer


def test_a_chat_template_saved_by_transformers_5_is_read_from_chat_template_jinja(tmp_path):
    """save_pretrained in transformers 5 writes the template to chat_template.jinja, not tokenizer_config.json:
    the probe frames prompts with it exactly as with the older layout."""
    older = get_tokenizer(f"hf:{write_chat_tokenizer(tmp_path / 'older')}")
    newer_dir = write_chat_tokenizer(tmp_path / "newer", template=False)
    (newer_dir / "chat_template.jinja").write_text(older.chat_template)
    newer = get_tokenizer(f"hf:{newer_dir}")
    assert newer.chat_template == older.chat_template and newer.chat_frame() == older.chat_frame()
    plain = get_tokenizer(f"hf:{write_chat_tokenizer(tmp_path / 'plain', template=False)}")
    assert (
        plain.chat_template is None and newer.fingerprint != plain.fingerprint
    )  # the template is keyed


def test_bos_and_chat_template_give_the_documented_tokens(tmp_path):
    chatml = write_chat_tokenizer(tmp_path / "chatml")
    tok = get_tokenizer(f"hf:{chatml}")
    start, end = (
        tok.bos_id,
        tok.eos_id,
    )  # <|im_start|> is this tokenizer's "BOS": it must never be used as one
    builders = probe_sources.Builders("noise")
    source = hf_source_for(chatml)

    def ids(**settings) -> list[int]:
        s = probe_settings.ProbeSettings(haystack="noise", max_new_tokens=16, **settings)
        return builders.for_source(source, s).build(700, 0, 0).input_ids.tolist()

    plain = ids()
    assert start not in plain and tok.decode(plain).startswith(INSTRUCTION)
    assert tok.decode(plain).endswith(QUESTION + "\n" + ANSWER_PREFIX)
    assert ids(bos="always")[0] == start and ids(bos="always")[1:50] == plain[:49]
    chat = ids(chat_template=True)
    text = tok.decode(chat)
    assert (
        chat[0] == start and chat.count(start) == 2 and chat.count(end) == 1
    )  # special ids, not text
    assert text.startswith("<|im_start|>user\n" + INSTRUCTION)
    assert text.endswith(QUESTION + "<|im_end|>\n<|im_start|>assistant\n" + ANSWER_PREFIX)
    assert (
        ids(chat_template=True, bos="auto") == chat
    )  # auto never adds a BOS of its own to a template
    with pytest.raises(probe_settings.ProbeError, match="no chat template"):
        builders.for_source(
            hf_source_for(write_chat_tokenizer(tmp_path / "plain", template=False)),
            probe_settings.ProbeSettings(haystack="noise", chat_template=True),
        )
    llama = write_chat_tokenizer(tmp_path / "llama", template=False, llama_bos=True)
    assert get_tokenizer(f"hf:{llama}").adds_bos and not tok.adds_bos
    llama_ids = builders.for_source(
        hf_source_for(llama), probe_settings.ProbeSettings(haystack="noise", max_new_tokens=16)
    )
    assert llama_ids.build(700, 0, 0).input_ids[0] == 0  # the post-processor's BOS


def test_a_tokenizer_without_bos_frames_prompts_without_one(tmp_path):
    """Qwen's tokenizers have no BOS (bos_token null, add_bos_token false): the probe builds its prompts and chat
    frames without one, and refuses --bos always by name instead of inventing a token."""
    qwen = write_chat_tokenizer(tmp_path / "qwen", no_bos=True)
    tok = get_tokenizer(f"hf:{qwen}")
    assert tok.bos_id is None and not tok.adds_bos and tok.eos_id == 1  # <|im_end|>
    builders = probe_sources.Builders("noise")
    source = hf_source_for(qwen)

    def text(**settings) -> str:
        s = probe_settings.ProbeSettings(haystack="noise", max_new_tokens=16, **settings)
        return tok.decode(builders.for_source(source, s).build(700, 0, 0).input_ids.tolist())

    assert text().startswith(INSTRUCTION) and text(bos="never") == text()
    assert text(chat_template=True).startswith("<|im_start|>user\n" + INSTRUCTION)
    with pytest.raises(
        probe_settings.ProbeError,
        match=r"--bos always \(which asks for one\): tokenizer .* has no BOS",
    ):
        text(bos="always")
    # the builder itself, called as a library, names its own argument (not a CLI flag)
    from posfreq.analysis.niah.needles import NiahBuilder, PromptFormat

    with pytest.raises(
        ValueError, match=r"PromptFormat\(bos=True\) but tokenizer .* no BOS.*bos=False"
    ):
        NiahBuilder(tok, builders.haystack, PromptFormat(16, True, (), ()))
    # a tokenizer whose config names no BOS but whose post-processor puts one first has that BOS (it was taken
    # for BOS-less, and prompts lost the token the model trained with)
    lead_dir = write_chat_tokenizer(tmp_path / "lead", template=False, llama_bos=True)
    (lead_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    lead = get_tokenizer(f"hf:{lead_dir}")
    assert lead.bos_id == 0 and lead.adds_bos
    # a config that names a BOS, or asks for one, the vocabulary does not have is damage, named
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    for change, says in (
        ({"bos_token": "<s>"}, "names '<s>', which is not in its vocabulary"),
        ({"add_bos_token": True}, "although its tokenizer_config.json sets add_bos_token"),
    ):
        (qwen / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=says):
            get_tokenizer(f"hf:{qwen}")


def test_a_hostile_chat_template_cannot_reach_python(tmp_path):
    directory = write_chat_tokenizer(tmp_path / "evil")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        get_tokenizer(f"hf:{directory}").chat_frame()


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
@pytest.mark.parametrize(
    "template,message",
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "within 2 s",
        ),
        (
            "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
            "more than 1,000,000 characters",
        ),
        ("{{ range(10**5) | list | length }}{{ range(10**9) | list }}", "OverflowError"),
        ("{% set x = [0] * 10**7 %}{{ x | length }}", "repetition of 10,000,000 items"),
        ("{{ 'a' * 10**8 }}", "repetition of 100,000,000 items"),
        ("{{ 2 ** 100000000 }}", "power beyond 64"),
    ],
)
def test_a_chat_template_that_loops_or_overflows_is_one_error(tmp_path, template, message):
    import time

    directory = write_chat_tokenizer(tmp_path / "t")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        get_tokenizer(f"hf:{directory}").chat_frame()
    assert time.monotonic() - started < 30


def test_a_consolidated_copy_has_the_checkpoints_fingerprint(tmp_path):
    """Results are keyed by the model, not by optimizer state or file layout: a consolidation shares them."""
    from posfreq.scripts.commands.checkpoint import consolidate
    from posfreq.train.checkpoint.load import model_fingerprint

    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["optimizer"] = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}
    torch.save(state, ckpt / "state.pt")  # optimizer state beside the weights
    copy = consolidate(ckpt, tmp_path / "consolidated")
    assert model_fingerprint(copy) == model_fingerprint(ckpt)
    assert model_fingerprint(
        consolidate(ckpt, tmp_path / "bf16", dtype=torch.bfloat16)
    ) != model_fingerprint(ckpt)


def test_a_missing_or_unreadable_source_is_a_probe_error_the_cli_prints_as_one_line(tmp_path):
    """Library code raises ProbeError with the fix; only the CLI turns it into `error: ...` and exit 1."""
    settings = probe_settings.ProbeSettings(haystack="noise")
    with pytest.raises(
        probe_settings.ProbeError, match="does not exist. Fix: pass RUN/checkpoints"
    ):
        probe_sources.checkpoint_source(tmp_path / "missing", settings)
    with pytest.raises(
        probe_settings.ProbeError, match="is not a checkpoint .no model_config.json"
    ):
        probe_sources.checkpoint_source(tmp_path, settings)
    with pytest.raises(probe_settings.ProbeError, match="no complete checkpoints"):
        probe_sources.milestones(tmp_path)
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    (ckpt / "tokenizer_spec.json").unlink()
    with pytest.raises(
        probe_settings.ProbeError, match="no tokenizer_spec.json. Fix: pass --tokenizer"
    ):
        probe_sources.checkpoint_source(ckpt, settings)
    source = probe_sources.checkpoint_source(ckpt, replace(settings, tokenizer="bytes"))
    assert source.tokenizer_spec == "bytes" and source.tokens_trained == source.run_tokens == 1024
    with pytest.raises(SystemExit) as stop:
        probe.main(["--checkpoint", str(tmp_path / "missing"), "--quiet"])
    assert stop.value.code == (
        f"error: --checkpoint {tmp_path / 'missing'} does not exist. Fix: pass "
        "RUN/checkpoints/tokens-*/ (or latest/), a consolidated model directory, or --run RUN for "
        "every milestone"
    )


@pytest.mark.slow
def test_a_checkpoints_tokenizer_is_checked_by_content_before_probing_or_exporting(
    tmp_path, monkeypatch
):
    """Checkpoints stored the tokenizer as prepare was given it (hf:tokR, relative to where it ran): probing from
    elsewhere loaded whatever tokR was there, unchecked. The spec is absolute now, with the tokenizer's content,
    and the probe and export refuse a tokenizer whose files changed since."""
    import json

    from posfreq.scripts.commands import export_hf
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer, write_llama3_tokenizer

    monkeypatch.chdir(tmp_path)
    write_bytes_tokenizer(tmp_path / "tokR")
    tokenizer = get_tokenizer("hf:tokR")
    assert tokenizer.name == f"hf:{(tmp_path / 'tokR').resolve()}"  # what prepare records
    checkpoint = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.zeros(8), spec="bytes")
    spec = json.loads((checkpoint / "tokenizer_spec.json").read_text())
    spec.update(spec=tokenizer.name, fingerprint=tokenizer.fingerprint)  # as the trainer writes it
    (checkpoint / "tokenizer_spec.json").write_text(json.dumps(spec))
    settings = probe_settings.ProbeSettings(haystack="noise", max_new_tokens=16)
    assert probe_sources.checkpoint_source(checkpoint, settings).tokenizer_spec == tokenizer.name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tokR" / name).unlink()
    write_llama3_tokenizer(tmp_path / "tokR")  # another tokenizer under the same name
    with pytest.raises(
        probe_settings.ProbeError, match="not, by content, the one the run trained with"
    ):
        probe_sources.checkpoint_source(checkpoint, settings)
    with pytest.raises(SystemExit, match="not, by content, the one the run trained with"):
        export_hf.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")])


@pytest.mark.slow  # writes and loads the llama3 tokenizer's files
def test_a_moved_runs_tokenizer_is_named_by_override_and_checked_by_content(tmp_path):
    """A run's folders moved (a demo folder, say): the checkpoint names an hf:DIR that is gone, and the probe
    failed with a bare FileNotFoundError. It now names the fix, --tokenizer, and checks an override by content
    like the recorded spec (an override was taken unchecked: another tokenizer's ids probed nonsense)."""
    import shutil

    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer, write_llama3_tokenizer

    write_bytes_tokenizer(tmp_path / "old" / "T")
    tokenizer = get_tokenizer(f"hf:{tmp_path / 'old' / 'T'}")
    checkpoint = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.zeros(8), spec="bytes")
    spec = json.loads((checkpoint / "tokenizer_spec.json").read_text())
    spec.update(spec=tokenizer.name, fingerprint=tokenizer.fingerprint)  # as the trainer writes it
    (checkpoint / "tokenizer_spec.json").write_text(json.dumps(spec))
    shutil.move(tmp_path / "old", tmp_path / "new")
    settings = probe_settings.ProbeSettings(haystack="noise", max_new_tokens=16)
    with pytest.raises(
        probe_settings.ProbeError, match=r"which is not there now.*--tokenizer hf:<its new"
    ):
        probe_sources.checkpoint_source(checkpoint, settings)

    moved = f"hf:{tmp_path / 'new' / 'T'}"
    source = probe_sources.checkpoint_source(checkpoint, replace(settings, tokenizer=moved))
    assert source.tokenizer_spec == moved
    builtin = replace(
        settings, tokenizer="bytes"
    )  # the built-in its files were exported from: one tokenizer
    assert probe_sources.checkpoint_source(checkpoint, builtin).tokenizer_spec == "bytes"
    write_llama3_tokenizer(tmp_path / "L")
    with pytest.raises(probe_settings.ProbeError, match=r"--tokenizer hf:.*L is not, by content"):
        probe_sources.checkpoint_source(
            checkpoint, replace(settings, tokenizer=f"hf:{tmp_path / 'L'}")
        )

    from posfreq.scripts.commands import export_hf  # the same rule, by the same function

    export = ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]
    with pytest.raises(SystemExit, match="which is not there now"):
        export_hf.main(export)
    with pytest.raises(SystemExit, match="is not, by content"):
        export_hf.main([*export, "--tokenizer", f"hf:{tmp_path / 'L'}"])
    assert export_hf.main([*export, "--tokenizer", moved]) == 0


def test_ruler_renders_chat_templates_in_the_bounded_sandbox_not_transformers(tmp_path):
    """`ruler --chat-template true` rendered through transformers' Jinja: nested range(100000) loops ran past
    150 s. The tokenizer lm-eval is handed renders in posfreq's sandbox: bounded, and the same text otherwise."""
    import time

    from transformers import AutoTokenizer

    from posfreq.train.data.hf_tokenizer import render_in_sandbox

    directory = write_chat_tokenizer(tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    conversation = [{"role": "user", "content": "Where is the needle?"}]
    expected = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    render_in_sandbox(tokenizer)
    assert (
        tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        == expected
    )
    continued = [*conversation, {"role": "assistant", "content": "The needle is"}]
    assert tokenizer.apply_chat_template(
        continued, tokenize=False, continue_final_message=True
    ).endswith("<|im_start|>assistant\nThe needle is")
    tokenizer.chat_template = "{{ '%100000000d' % 1 }}"
    started = time.monotonic()
    with pytest.raises(ValueError, match="width"):
        tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert time.monotonic() - started < 2


def test_a_transformers_folder_gives_its_length_under_its_own_key_name(tmp_path):
    """GPT-2 names its trained length n_positions: the transformers engine reads it as transformers does (the raw
    config.json has no max_position_embeddings), and a config that states none is a ProbeError naming the file,
    not transformers' class default taken for the model's length."""
    transformers = pytest.importorskip("transformers")
    from posfreq.train.data.hf_tokenizer import write_tokenizer_files

    directory = tmp_path / "gpt2"
    config = transformers.GPT2Config(
        vocab_size=258,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=96,
        bos_token_id=0,
        eos_token_id=1,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    write_tokenizer_files("bytes", directory)
    assert "max_position_embeddings" not in json.loads((directory / "config.json").read_text())
    settings = probe_settings.ProbeSettings(engine="transformers")
    source = probe_sources.hf_source(directory, settings)
    assert (source.train_len, source.vocab_size) == (96, 258)
    raw = json.loads((directory / "config.json").read_text())
    del raw["n_positions"]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        probe_settings.ProbeError,
        match=r"gpt2/config.json states no max_position_embeddings \(n_positions\)",
    ):
        probe_sources.hf_source(directory, settings)


def test_a_multimodal_folder_gives_its_text_models_length_and_vocabulary(tmp_path):
    """A LLaVA-style config keeps the language model's sizes in text_config: they are read there, and a size stated
    only at the top level (where transformers does not read it for the text model) is refused, not defaulted."""
    pytest.importorskip("transformers")
    nested = {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "vocab_size": 258, "max_position_embeddings": 96},
    }
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert probe_sources._length_and_vocabulary(tmp_path, nested) == (96, 258)
    top = {
        **nested,
        "vocab_size": 258,
        "text_config": {"model_type": "llama", "max_position_embeddings": 96},
    }
    (tmp_path / "config.json").write_text(json.dumps(top))
    with pytest.raises(probe_settings.ProbeError, match="states no vocab_size"):
        probe_sources._length_and_vocabulary(tmp_path, top)
