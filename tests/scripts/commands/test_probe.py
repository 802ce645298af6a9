"""The probe's command line end to end on a real tiny Transformer: options and usage errors, every output
file, positions fed, every scheme, results keyed by content, one-line errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.probe import tiny_model, write_checkpoint

from posfreq.analysis.niah import decoding as probe_decoding
from posfreq.analysis.niah import runner as probe_runner
from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah import sources as probe_sources
from posfreq.analysis.niah import store
from posfreq.scripts.commands import probe
from posfreq.train.command_line import parse
from posfreq.train.model.transformer import Transformer
from posfreq.train.positions.schemes import SCHEMES


def quiet_noise_args(tests: int, out: Path) -> list[str]:
    """Probe flags: `tests` tests per length on the noise haystack, a 40-token answer budget, no figures."""
    flags = f"--tests-per-length {tests} --haystack noise --max-new-tokens 40 --quiet --no-figures"
    return [*flags.split(), "--out", str(out)]


def test_lengths_and_options_parsing():
    assert probe_settings.parse_lengths("128:512:128") == [128, 256, 384, 512]
    assert probe_settings.parse_lengths("512,128") == [128, 512]
    with pytest.raises(argparse.ArgumentTypeError):
        probe_settings.parse_lengths("128:512:0")
    args = parse(
        probe.build_parser(),
        [
            "--run",
            "r",
            "--position-options.shift",
            "1365",
            "--position-options.mode",
            "fast",
            "--teacher-forced",
            "false",
        ],
    )
    assert args.position_options == {"shift": 1365, "mode": "fast"} and args.teacher_forced is False


def test_settings_are_checked_and_precision_resolved():
    """Checks live in the dataclasses (so a library caller gets them too); the CLI turns them into usage errors."""
    with pytest.raises(ValueError, match="bos"):
        probe_settings.ProbeSettings(bos="sometimes")
    with pytest.raises(ValueError, match="tests_per_length"):
        probe_settings.ProbeSettings(tests_per_length=0)
    job = probe_runner.Job(probe_settings.ProbeSettings(), None, 1, torch.device("cpu"))
    assert job.settings.precision == "float32"  # auto on CPU, resolved before any key is computed
    with pytest.raises(ValueError, match="bfloat16-prefill is for CPUs"):
        probe_runner.Job(
            probe_settings.ProbeSettings(precision="bfloat16-prefill"),
            None,
            1,
            torch.device("cuda"),
        )
    capped = probe_runner.Job(
        probe_settings.ProbeSettings(), None, 8, torch.device("cpu"), batch_tokens=8192
    )
    assert [capped.batch_for(n) for n in (512, 1024, 4096, 8192, 32768)] == [8, 8, 2, 1, 1]
    assert (
        job.batch_for(32768) == 1
        and probe_runner.Job(
            probe_settings.ProbeSettings(), None, 8, torch.device("cpu")
        ).batch_for(32768)
        == 8
    )  # no token cap: the batch size at every length
    with pytest.raises(ValueError, match="prefill_tokens"):
        probe_runner.Job(
            probe_settings.ProbeSettings(), None, 8, torch.device("cpu"), prefill_tokens=0
        )
    for bad in (
        ["--tests-per-length", "0"],
        ["--batch-size", "0"],
        ["--batch-tokens", "0"],
        ["--prefill-tokens", "0"],
        ["--lengths", "1:2:0"],
        ["--shard", "3/2"],
        ["--positions", "nope"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            probe.main(["--checkpoint" if bad[0] != "--shard" else "--run", "x", *bad])
        assert exit_info.value.code == 2, bad


# ------------------------------------------------------------------ real tiny Transformer


@pytest.mark.slow
def test_batched_and_unbatched_decoding_agree_on_a_real_model(tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "run", 1024, tiny_model(), np.bincount([512, 300], minlength=513)
    )
    settings = probe_settings.ProbeSettings(tests_per_length=5, haystack="noise", max_new_tokens=40)
    source = probe_sources.checkpoint_source(ckpt, settings)
    assert (
        source.train_len == 512
        and source.tokenizer_spec == "bytes"
        and source.tokens_trained == 1024
    )
    model = source.load(settings, torch.device("cpu"))
    builder = probe_sources.Builders("noise").for_source(source, settings)
    tests = builder.make_tests(416, 5, 0)
    assert (
        tests[0].input_ids[0] != builder.tokenizer.bos_id
    )  # our checkpoints train without BOS: auto adds none
    cpu = torch.device("cpu")
    one = [
        probe_decoding.generate_answers(model, builder.tokenizer, [t], cpu, max_new_tokens=40)[0]
        for t in tests
    ]
    many = probe_decoding.generate_answers(model, builder.tokenizer, tests, cpu, max_new_tokens=40)
    assert one == many and len(set(one)) > 1
    # The CLI on the same checkpoint writes every output file and records the answers decoded above.
    out = tmp_path / "out"
    probe.main(
        [
            "--checkpoint",
            str(ckpt),
            "--lengths",
            "416",
            "--tests-per-length",
            "5",
            "--haystack",
            "noise",
            "--batch-size",
            "3",
            "--max-new-tokens",
            "40",
            "--out",
            str(out),
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    records = store.read_records(out, [416])
    assert [r["generated"] for r in records] == one
    assert all(len(r["tf_logprob"]) == 4 and all(lp < 0 for lp in r["tf_logprob"]) for r in records)
    for name in (
        "probe.json",
        "key.json",
        "summary.csv",
        "distance.csv",
        "effective_length.csv",
        "failure_by_thirds.csv",
        "failure_by_thirds.md",
        "trained_lengths.npy",
        "figures/niah_heatmap.png",
        "figures/niah_heatmap.pdf",
        "figures/failure_by_thirds.png",
    ):
        assert (out / name).is_file(), name
    meta = json.loads((out / "probe.json").read_text())
    assert meta["haystack_sha256"] == builder.haystack.sha256
    assert (
        meta["tokens_trained"] == 1024
        and meta["code_version"]
        and meta["prompt_format"]["bos"] is False
    )


@pytest.mark.slow
def test_no_token_is_generated_or_fed_at_a_position_beyond_the_test_length(tmp_path, monkeypatch):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    fed: list[tuple[int, int]] = []  # (first, last) position of every forward call
    original = Transformer.hidden_states

    def spy(self, input_ids, cu_seqlens, max_seqlen, caches=None, position_offset=0):
        fed.append((position_offset, position_offset + max_seqlen - 1))
        return original(self, input_ids, cu_seqlens, max_seqlen, caches, position_offset)

    monkeypatch.setattr(Transformer, "hidden_states", spy)
    out = tmp_path / "out"
    probe.main(["--checkpoint", str(ckpt), "--lengths", "420,512", *quiet_noise_args(3, out)])
    records = store.read_records(out, [420, 512])
    assert {r["prompt_length"] for r in records} == {420 - 40, 512 - 40}
    assert max(last for _, last in fed) <= 512 - 1
    decode_steps = [first for first, last in fed if first == last]  # one generated token fed back
    # The whole budget was used (this model never stops early): tokens fed at positions up to length - 2, the last
    # generated token sits at length - 1 and is never fed; nothing reaches a position >= the test length.
    assert {420 - 2, 512 - 2} <= set(decode_steps) and max(decode_steps) == 512 - 2


@pytest.mark.slow
def test_every_position_scheme_runs_through_the_probe(tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "run", 1024, tiny_model(), np.bincount([512, 300], minlength=513)
    )
    settings = probe_settings.ProbeSettings(haystack="noise")
    model = probe_sources.checkpoint_source(ckpt, settings).load(settings, torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 400))
    with torch.no_grad():
        rope = model(ids)
        for scheme in SCHEMES[1:]:  # every scheme changes what a 400-token input sees at L = 512
            model.set_positions(scheme)
            assert not torch.allclose(model(ids), rope, atol=1e-4), scheme
    for scheme in SCHEMES:
        out = tmp_path / scheme
        probe.main(
            ["--checkpoint", str(ckpt), "--positions", scheme, "--lengths", "420"]
            + quiet_noise_args(2, out)
        )
        assert json.loads((out / "probe.json").read_text())["settings"]["positions"] == scheme
        assert len(store.read_records(out, [420])) == 2


# ------------------------------------------------------------------ results keyed by content


@pytest.mark.slow
def test_same_folder_names_never_share_results(tmp_path, monkeypatch):
    hist = np.bincount([512], minlength=513)
    a = write_checkpoint(tmp_path / "A", 1024, tiny_model(seed=1), hist)
    b = write_checkpoint(tmp_path / "B", 1024, tiny_model(seed=2), hist)
    assert a.name == b.name
    monkeypatch.chdir(tmp_path)
    decoded: list[str] = []
    original = probe_runner.probe_length
    monkeypatch.setattr(
        probe_runner,
        "probe_length",
        lambda m, plan, *x: decoded.append(str(plan.source.path)) or original(m, plan, *x),
    )
    common = [
        "--lengths",
        "420",
        "--tests-per-length",
        "2",
        "--haystack",
        "noise",
        "--max-new-tokens",
        "40",
        "--quiet",
        "--no-figures",
    ]
    probe.main(["--checkpoint", str(a), *common])
    probe.main(["--checkpoint", str(b), *common])
    assert decoded == [str(a), str(b)]  # B decoded afresh, nothing of A's reused
    outs = sorted((tmp_path / "runs" / "probe").iterdir())
    assert len(outs) == 2 and all(o.name.startswith(a.name + "-") for o in outs)
    answers = [[r["generated"] for r in store.read_records(o, [420])] for o in outs]
    assert answers[0] != answers[1]
    probe.main(["--checkpoint", str(a), *common])  # the same model again: reused, not decoded
    assert decoded == [str(a), str(b)]
    # One explicit --out for both: the second is refused, and replaced only when asked.
    shared = tmp_path / "shared"
    probe.main(["--checkpoint", str(a), "--out", str(shared), *common])
    with pytest.raises(SystemExit, match="another key .*model"):
        probe.main(["--checkpoint", str(b), "--out", str(shared), *common])
    probe.main(["--checkpoint", str(b), "--out", str(shared), "--replace-stale", *common])
    assert [r["generated"] for r in store.read_records(shared, [420])] == answers[
        [o.name for o in outs].index(
            next(
                o.name
                for o in outs
                if json.loads((o / "probe.json").read_text())["model_path"] == str(b)
            )
        )
    ]


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513)
    )  # vocab 258
    with pytest.raises(SystemExit, match="128,256 ids but the model only 258"):
        probe.main(
            ["--checkpoint", str(ckpt), "--tokenizer", "llama3", "--lengths", "420", "--quiet"]
        )


def test_a_users_folder_is_refused_untouched_before_the_model_is_read(tmp_path, monkeypatch):
    """Issue 30: `probe --checkpoint CKPT --out U` with no key.json in U overwrote U's summary.csv, probe.json,
    effective_length.csv and figures and exited 0. U is refused in one line before the checkpoint is read."""
    from helpers.probe import snapshot

    from posfreq.analysis.niah import sources

    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    user = tmp_path / "U"
    (user / "figures").mkdir(parents=True)
    (user / "summary.csv").write_text("mine\n")
    (user / "probe.json").write_text('{"mine": true}\n')
    (user / "effective_length.csv").write_text("mine\n")
    (user / "figures" / "niah_heatmap.png").write_bytes(b"my figure")
    before = snapshot(user)
    for read in ("allowed", "forbidden"):
        if read == "forbidden":
            monkeypatch.setattr(  # the command imports it when it runs
                sources,
                "checkpoint_source",
                lambda *a: pytest.fail("the checkpoint was read first"),
            )
        with pytest.raises(SystemExit) as stop:
            probe.main(["--checkpoint", str(ckpt), "--lengths", "512", *quiet_noise_args(2, user)])
        assert str(stop.value.code) == (
            f"error: --out {user} holds files `posfreq probe` did not write (effective_length.csv, "
            "figures, probe.json, summary.csv). Fix: pass a new or empty directory (nothing was changed)"
        )
        assert snapshot(user) == before


def test_a_second_probe_on_one_result_folder_is_refused_while_the_first_runs(tmp_path):
    """Two probes writing one --out at once had no lock (store.claim checked, then wrote): the second is refused
    in one line while the first holds the folder, and a folder whose lock's process is gone is taken over."""
    import json
    import os
    import socket

    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    out = tmp_path / "out"
    args = ["--checkpoint", str(ckpt), "--lengths", "512", *quiet_noise_args(2, out)]
    assert probe.main(args) == 0
    assert not (out / "run.lock").exists()  # released
    holder = {"job": None, "pid": os.getppid(), "host": socket.gethostname(), "started": "now"}
    (out / "run.lock").write_text(json.dumps(holder))  # a probe still running on this host
    with pytest.raises(SystemExit, match=r"error: .*out is in use by .* Fix: wait for it to end"):
        probe.main(args)
    holder["pid"] = 2**22 + 12345  # a process that no longer runs
    (out / "run.lock").write_text(json.dumps(holder))
    assert probe.main(args) == 0 and not (out / "run.lock").exists()


@pytest.mark.slow
def test_a_refused_probe_leaves_no_folder_and_left_out_lengths_are_named(tmp_path, capsys):
    """An answer budget too small for the teacher-forced answer is refused before any result folder is made
    (a half-made probe-*/ with empty checkpoint folders was left in the run); default lengths below the shortest
    test are named, not left out in silence."""
    run = tmp_path / "run"
    write_checkpoint(run, 1024, tiny_model(), np.bincount([512], minlength=513))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    argv = [
        "--run",
        str(run),
        "--tests-per-length",
        "1",
        "--haystack",
        "noise",
        "--quiet",
        "--no-figures",
    ]
    with pytest.raises(SystemExit, match="Fix: --max-new-tokens"):
        probe.main([*argv, "--max-new-tokens", "4"])
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert probe.main([*argv, "--max-new-tokens", "40"]) == 0
    err = capsys.readouterr().err
    assert "lengths 128-" in err and "left out: the shortest test" in err and "probing " in err


def test_a_damaged_record_found_when_the_tables_are_derived_is_one_error_line(tmp_path, capsys):
    """A rerun reuses a finished length, then derives its tables from the stored records: a record damaged
    meanwhile stops the command with the file, the record and the fix, not a traceback."""
    ckpt = write_checkpoint(tmp_path / "run", 512, tiny_model(), np.bincount([512], minlength=513))
    out = tmp_path / "out"
    argv = ["--checkpoint", str(ckpt), "--lengths", "420", *quiet_noise_args(2, out)]
    assert probe.main(argv) == 0
    jsonl = store.length_files(out, 420)[0]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    records[1]["tf_token_accuracy"] = [1.0, 2.0, 0.0, 0.0]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(SystemExit) as stop:
        probe.main(argv)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "tf_token_accuracy must be a number" in message
    assert str(jsonl.name) in message or str(out) in message
