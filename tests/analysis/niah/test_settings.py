"""The probe's settings and result key: every setting, the prompts and the weights change the key."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from helpers.probe import tiny_model, write_chat_tokenizer, write_checkpoint

from posfreq.analysis.keys import probe_result_key
from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah import sources as probe_sources


def test_every_setting_and_the_weights_change_the_key_and_the_number_of_tests_does_not(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    base = probe_settings.ProbeSettings(haystack="noise")
    variants = [
        base,
        *(
            replace(base, **{k: v})
            for k, v in (
                ("seed", 1),
                ("max_new_tokens", 64),
                ("positions", "string"),
                ("position_options", {"shift": 100}),
                ("precision", "bfloat16"),
                ("teacher_forced", False),
                ("greedy", False),
                ("answer_order", "nearest_first"),
                ("bos", "always"),
                ("haystack", "pg"),
                ("tokenizer", f"hf:{write_chat_tokenizer(tmp_path / 'tok', template=False)}"),
            )
        ),
    ]

    def key_of(settings: probe_settings.ProbeSettings) -> str:
        source = probe_sources.checkpoint_source(ckpt, settings)
        builder = probe_sources.Builders(settings.haystack).for_source(source, settings)
        return probe_result_key(source, builder, settings)[0]

    assert len({key_of(settings) for settings in variants}) == len(variants)
    # test i is the same in a probe of any size, so more tests extend the same results
    assert key_of(replace(base, tests_per_length=7)) == key_of(base)
    source = probe_sources.checkpoint_source(ckpt, base)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["model"]["norm.weight"][0] += 1e-3
    torch.save(state, ckpt / "state.pt")
    assert probe_sources.checkpoint_source(ckpt, base).fingerprint != source.fingerprint


def test_a_runs_key_is_the_result_key_without_the_model(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    settings = probe_settings.ProbeSettings(haystack="noise")
    source = probe_sources.checkpoint_source(ckpt, settings)
    builder = probe_sources.Builders("noise").for_source(source, settings)
    key, parts = probe_result_key(source, builder, settings)
    run_key, run_parts = probe_result_key(source, builder, settings, model=False)
    assert len(key) == len(run_key) == 16 and key != run_key
    assert parts == {**run_parts, "model": source.fingerprint}


def test_a_probe_without_decoding_scores_only_under_teacher_forcing(capsys):
    import pytest

    from posfreq.analysis.tables.pass_curve import Analysis
    from posfreq.scripts.commands import probe as probe_command

    with pytest.raises(ValueError, match="leave nothing to measure"):
        probe_settings.ProbeSettings(greedy=False, teacher_forced=False)
    settings = probe_settings.ProbeSettings(greedy=False)
    assert probe_settings.ProbeSettings().decoding().get("greedy") is None  # older keys unchanged
    assert settings.decoding()["greedy"] is False
    # the command refuses the pair before any model is read (the model named here does not exist)
    with pytest.raises(SystemExit) as refused:
        probe_command.main(["--model", "hf:/nowhere", "--greedy", "false", "--device", "cpu"])
    assert refused.value.code == 2
    assert "Fix: add --scoring teacher_forced" in capsys.readouterr().err
    record = {"tf_token_accuracy": [1.0, 0.75, 1.0, 0.0], "hits_anywhere": [False] * 4}
    tf = Analysis(scoring="teacher_forced")
    assert tf.hits(record) == [True, False, True, False] and tf.passed(record)
    assert not Analysis().passed(record) and Analysis(min_retrieved=3).tf_passed(record) is False
