"""`posfreq loss-by-distance` on one of our checkpoints and token shards: the table the trainer's validation would
store, its CSV joined with f at each distance, a figure; a model of another tokenizer is refused in one line."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest
from helpers.hf import save_tiny_hf
from helpers.probe import tiny_model, write_checkpoint

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.scripts.commands import loss_by_distance as command
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.load import load_model
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.run.loss_by_distance import ScoredRows, measure

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_a_checkpoint_on_token_shards(data_dir, tmp_path, capsys, monkeypatch):
    hist = np.bincount([3, 100, 100, 511, 7], minlength=513)
    path = write_checkpoint(tmp_path / "run", 4096, tiny_model(), hist)
    out = tmp_path / "lbd"
    argv = ["--checkpoint", str(path), "--data", str(data_dir), "--rows", "6", "--train-len", "128"]
    plans = []
    real_check = command.check_rows
    for module in (command, sys.modules[measure.__module__]):  # the command's and the library's
        monkeypatch.setattr(module, "check_rows", lambda *a: plans.append(1) or real_check(*a))
    assert command.main([*argv, "--out", str(out)]) == 0
    assert (
        len(plans) == 1
    )  # the rows are planned once: checked before --out is claimed, then measured
    stored = json.loads((out / "loss_by_distance.json").read_text())
    model, _, _ = load_model(path)
    again = measure(model, ScoredRows(TokenDataset(data_dir), 128, 6, batch_rows=4))  # the library
    assert stored["tokens"] == again.tokens.tolist() and np.allclose(
        stored["loss_sum"], again.loss_sum
    )
    with open(out / "loss_by_distance.csv") as fh:
        rows = list(csv.DictReader(fh))
    f = position_frequency(hist, 512)
    assert [int(r["distance_lo"]) for r in rows] == stored["edges"][:-1]
    assert all(float(r["f_distance_lo"]) == f[int(r["distance_lo"])] for r in rows)
    assert sum(int(r["tokens"]) for r in rows) == sum(stored["tokens"]) > 0
    assert (out / "loss_by_distance.png").stat().st_size > 0
    assert "mean loss" in capsys.readouterr().out

    llama = write_checkpoint(tmp_path / "other", 4096, tiny_model(), hist, spec="llama3")
    code = command.main(
        ["--checkpoint", str(llama), "--data", str(data_dir), "--out", str(tmp_path / "x")]
    )
    assert code == 1 and "not the model's tokenizer" in capsys.readouterr().err


def test_a_checkpoint_whose_tokenizer_changed_since_training_is_refused(data_dir, tmp_path, capsys):
    """As the probe and export-hf do: the tokenizer its spec names now must be, by content, the one it trained with."""
    hist = np.bincount([3, 100], minlength=513)
    path = write_checkpoint(tmp_path / "run", 4096, tiny_model(), hist)
    spec = json.loads((path / ckpt.TOKENIZER_FILE).read_text())
    (path / ckpt.TOKENIZER_FILE).write_text(json.dumps({**spec, "fingerprint": "0" * 16}))
    out = tmp_path / "lbd"
    argv = ["--checkpoint", str(path), "--data", str(data_dir), "--out", str(out)]
    assert command.main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ")
        and "not, by content, the one the run trained with" in err
        and "Fix:" in err
    )
    assert command.main([*argv, "--tokenizer", "bytes"]) == 1  # an override is checked the same way
    assert "--tokenizer bytes is not, by content, the tokenizer" in capsys.readouterr().err
    assert not (out / "loss_by_distance.json").exists()
    with pytest.raises(SystemExit):
        command.main(["--model", "hf:x", "--tokenizer", "bytes", "--data", "d", "--out", str(out)])
    assert "--tokenizer is for --checkpoint" in capsys.readouterr().err


def test_a_qwen2_model_through_transformers_on_shards_of_its_tokenizer(tmp_path, capsys):
    """--model hf:DIR --engine transformers: a model posfreq cannot import (Qwen2, q/k/v biases) is measured as
    transformers loads it, on shards prepared with the folder's tokenizer; the table is the library's."""
    pytest.importorskip("transformers")
    from posfreq.scripts.commands import prepare
    from posfreq.train.positions.hf_schemes import load_causal_lm

    model_dir = save_tiny_hf(
        tmp_path / "qwen2",
        "qwen2",
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    corpus = tmp_path / "corpus.jsonl"
    words = "the quick brown fox jumps over the lazy dog".split()
    corpus.write_text(
        "".join(
            json.dumps({"text": " ".join(words[: 3 + i % 7] * (1 + i))}) + "\n" for i in range(12)
        )
    )
    data = tmp_path / "shards"
    spec = f"hf:{model_dir}"
    assert prepare.main(["--corpus", str(corpus), "--tokenizer", spec, "--out", str(data)]) == 0
    out = tmp_path / "lbd"
    argv = ["--model", spec, "--engine", "transformers", "--data", str(data), "--rows", "4"]
    assert command.main([*argv, "--train-len", "128", "--out", str(out)]) == 0
    stored = json.loads((out / "loss_by_distance.json").read_text())
    assert stored["engine"] == "transformers" and sum(stored["tokens"]) > 300
    again = measure(
        load_causal_lm(model_dir), ScoredRows(TokenDataset(data), 128, 4), per_segment=True
    )
    assert stored["tokens"] == again.tokens.tolist()
    assert np.allclose(stored["loss_sum"], again.loss_sum)
    assert "mean loss" in capsys.readouterr().out

    argv = ["--checkpoint", str(model_dir), "--engine", "transformers", "--data", str(data)]
    with pytest.raises(SystemExit):
        command.main([*argv, "--out", str(tmp_path / "x")])
    assert "pass --model hf:DIR" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_rows_are_packed_as_the_checkpoints_run_validated_them(data_dir, tmp_path, capsys):
    """--packing left out: the checkpoint's own data.packing (its trainer.json), else the trainer's default, concat;
    a value that is none of the strategies is refused naming the file."""
    hist = np.bincount([3, 100], minlength=513)
    path = write_checkpoint(tmp_path / "run", 4096, tiny_model(), hist)
    argv = ["--checkpoint", str(path), "--data", str(data_dir), "--rows", "3", "--train-len", "128"]
    model, _, _ = load_model(path)

    def stored(out):
        assert command.main([*argv, "--out", str(tmp_path / out)]) == 0
        return json.loads((tmp_path / out / "loss_by_distance.json").read_text())

    plain = stored("plain")
    concat = measure(model, ScoredRows(TokenDataset(data_dir), 128, 3, 4, "concat"))
    assert plain["packing"] == "concat" and plain["tokens"] == concat.tokens.tolist()
    state = json.loads((path / "trainer.json").read_text())
    (path / "trainer.json").write_text(
        json.dumps({**state, "config": {"data": {"packing": "padded"}}})
    )
    padded = measure(model, ScoredRows(TokenDataset(data_dir), 128, 3, 4, "padded"))
    assert padded.tokens.tolist() != concat.tokens.tolist()  # the two packings differ on these rows
    recorded = stored("recorded")
    assert recorded["packing"] == "padded" and recorded["tokens"] == padded.tokens.tolist()
    (path / "trainer.json").write_text(
        json.dumps({**state, "config": {"data": {"packing": "zip"}}})
    )
    assert command.main([*argv, "--out", str(tmp_path / "bad")]) == 1
    assert "trainer.json: data.packing 'zip'" in capsys.readouterr().err


def test_rows_beyond_the_data_and_a_zero_length_are_refused(data_dir, tmp_path, capsys):
    """More rows than the shards fill once at --train-len re-read the same tokens (the audit counted 99,045 targets
    from 47,728 tokens); they are refused saying how many rows the data holds. --train-len 0 is no length (it was
    taken for 'the model's own')."""
    hist = np.bincount([3, 100], minlength=513)
    path = write_checkpoint(tmp_path / "run", 4096, tiny_model(), hist)
    held = TokenDataset(data_dir).num_tokens // 512  # concat: whole rows of one pass
    argv = ["--checkpoint", str(path), "--data", str(data_dir), "--train-len", "512"]
    code = command.main([*argv, "--rows", str(held + 1), "--out", str(tmp_path / "over")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: {data_dir} holds {held} rows of 512 tokens")
    assert f"Fix: ask for at most {held} rows" in err
    assert not (tmp_path / "over").exists()  # refused before its --out was claimed
    huge = ["--checkpoint", str(path), "--data", str(data_dir), "--train-len", "10000000"]
    assert command.main([*huge, "--rows", "1", "--out", str(tmp_path / "huge")]) == 1
    assert "holds 0 rows of 10000000 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command.main([*argv[:4], "--train-len", "0", "--out", str(tmp_path / "zero")])
    assert "--train-len must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "zero").exists()


@pytest.mark.slow
def test_an_exported_model_is_measured_on_the_shards_it_trained_on(data_dir, tmp_path, capsys):
    """A checkpoint trained on `bytes` shards, exported with export-hf, carries those bytes as Hugging Face files:
    the same tokenizer by content, so --model hf:EXPORT measures on the same shards, with the checkpoint's
    numbers. Another tokenizer's files are still refused."""
    from posfreq.scripts.commands import export_hf

    path = write_checkpoint(
        tmp_path / "run", 4096, tiny_model(), np.bincount([3, 100], minlength=513)
    )
    exported = tmp_path / "hf"
    assert export_hf.main(["--checkpoint", str(path), "--out", str(exported)]) == 0
    common = ["--data", str(data_dir), "--rows", "4", "--train-len", "128"]
    assert command.main(["--checkpoint", str(path), *common, "--out", str(tmp_path / "a")]) == 0
    assert command.main(["--model", f"hf:{exported}", *common, "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "loss_by_distance.json").read_text()) for d in "ab")
    assert a["tokens"] == b["tokens"] and np.allclose(a["loss_sum"], b["loss_sum"], rtol=1e-5)
    (exported / "tokenizer.json").write_text(
        (exported / "tokenizer.json").read_text().replace('"ignore_merges"', '"ignore_merges" ', 1)
        + " "
    )  # other bytes: another tokenizer by content
    capsys.readouterr()
    assert command.main(["--model", f"hf:{exported}", *common, "--out", str(tmp_path / "c")]) == 1
    assert "not the model's tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before its --out was claimed


def test_a_rerun_of_export_hf_keeps_the_results_another_command_wrote_inside_it(data_dir, tmp_path):
    """The review's route: export-hf --out E; loss-by-distance --model hf:E --out E/lbd; export-hf --out E again.
    The rerun replaced its own files and deleted E/lbd with them; now E/lbd stays as loss-by-distance wrote it."""
    from posfreq.scripts.commands import export_hf

    path = write_checkpoint(
        tmp_path / "run", 4096, tiny_model(), np.bincount([3, 100], minlength=513)
    )
    exported = tmp_path / "E"
    assert export_hf.main(["--checkpoint", str(path), "--out", str(exported)]) == 0
    common = ["--data", str(data_dir), "--rows", "2", "--train-len", "128"]
    assert command.main(["--model", f"hf:{exported}", *common, "--out", str(exported / "lbd")]) == 0
    before = {p.name: p.read_bytes() for p in (exported / "lbd").iterdir() if p.is_file()}
    assert export_hf.main(["--checkpoint", str(path), "--out", str(exported)]) == 0
    after = {p.name: p.read_bytes() for p in (exported / "lbd").iterdir() if p.is_file()}
    assert after == before and "loss_by_distance.json" in after
    assert (exported / "model.safetensors").is_file()


def test_a_huge_train_len_is_refused_at_once_against_the_datas_size(data_dir, tmp_path, capsys):
    """--train-len 10^12 planned rows until the one-line error, its time growing with the value: the data's token
    count now refuses it before any plan."""
    import time

    path = write_checkpoint(
        tmp_path / "run", 4096, tiny_model(), np.bincount([3, 100], minlength=513)
    )
    start = time.perf_counter()
    argv = [
        "--checkpoint",
        str(path),
        "--data",
        str(data_dir),
        "--rows",
        "2",
        "--out",
        str(tmp_path / "o"),
    ]
    assert command.main([*argv, "--train-len", "1000000000000"]) == 1
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 5
    assert (
        "holds 0 rows of 1000000000000 tokens (concat packing), not the 2 asked for" in err
        and "Fix: ask for rows shorter than its" in err
    )
    assert not (tmp_path / "o").exists()
