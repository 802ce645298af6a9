"""The README's laptop path, end to end: prepare -> pretrain -> probe -> compare -> export-hf, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posfreq.scripts.cli import main as posfreq

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.slow,
]  # one_thread: tests/conftest.py


def test_the_laptop_recipe_trains_a_model_the_probe_measures_up_to_its_training_length(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    config = json.loads(
        json.dumps(__import__("yaml").safe_load((ROOT / "configs/tiny_cpu.yaml").read_text()))
    )
    train_len = config["data"]["train_len"]
    assert (
        posfreq(
            [
                "prepare",
                "--corpus",
                "pg-essays",
                "--tokenizer",
                "bytes",
                "--out",
                "data/pg-essays-bytes",
            ]
        )
        == 0
    )
    assert (
        posfreq(
            [
                "pretrain",
                "--config",
                str(ROOT / "configs/tiny_cpu.yaml"),
                "--total-tokens",
                "32768",
                "--checkpoint.every-tokens",
                "16384",
            ]
        )
        == 0
    )
    milestones = sorted(Path("runs/tiny_cpu/checkpoints").glob("tokens-*"))
    assert [m.name for m in milestones] == ["tokens-000000000016384", "tokens-000000000032768"]
    capsys.readouterr()
    assert (
        posfreq(
            [
                "probe",
                "--run",
                "runs/tiny_cpu",
                "--tests-per-length",
                "2",
                "--quiet",
                "--no-figures",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert [
        line.split(":")[0] for line in printed.splitlines() if ": effective length" in line
    ] == [m.name for m in milestones]
    table = (
        next(Path("runs/tiny_cpu").glob("probe-*/effective_length.csv")).read_text().splitlines()
    )
    probed = [
        int(c.removeprefix("pass_rate_")) for c in table[0].split(",") if c.startswith("pass_rate_")
    ]
    assert probed and max(probed) == train_len  # measurable up to the training length, none skipped
    assert posfreq(["compare", "runs/tiny_cpu", "--out", "runs/compare", "--no-figures"]) == 0
    import csv

    with open("runs/compare/checkpoints.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["seed"], r["train_len"]) for r in rows] == [
        ("0", str(train_len))
    ] * 2  # the seed read, not dropped
    assert posfreq(["export-hf", "--checkpoint", str(milestones[-1]), "--out", "runs/hf"]) == 0
    from posfreq.train.checkpoint.load import load_model
    from posfreq.train.model.hf import load_hf_model

    ours, _, _ = load_model(milestones[-1])
    exported = load_hf_model("runs/hf")
    ids = torch.arange(64) % 256
    torch.testing.assert_close(exported(ids), ours(ids), rtol=1e-5, atol=1e-5)
