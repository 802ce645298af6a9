"""make gpu-check (train/preflight/gpu_check.py) without a GPU: what a CPU runs passes, every GPU stage is named as skipped
with its reason, and a stage past its budget fails even if it catches every Exception."""

from __future__ import annotations

import json
import time

import pytest

from posfreq.train.preflight import gpu_check


def test_a_stage_past_its_budget_fails_even_when_it_catches_exceptions():
    def swallowing() -> str:
        try:
            while True:
                time.sleep(0.01)
        except Exception:  # what a stage that reports a kernel's failure as its finding does
            return "a finding"

    with pytest.raises(TimeoutError, match="over its budget of 0 s"):
        gpu_check.within_budget(swallowing, 0.2)
    assert gpu_check.within_budget(lambda: "done", 5) == "done"


@pytest.mark.slow  # every CPU stage: a transformers model, the loss, flex attention
def test_without_a_gpu_it_runs_what_a_cpu_can_and_names_the_rest(tmp_path, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: make gpu-check runs every stage there")
    monkeypatch.setattr(gpu_check, "nvidia_driver", lambda: None)
    report = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(tmp_path / "work"), "--json", str(report)]) == 0
    stages = {s["name"]: s for s in json.loads(report.read_text())["stages"]}
    ran = {name for name, s in stages.items() if s["status"] == "PASS"}
    assert ran == {"environment", "attention-flex", "loss", "string-hf"}
    skipped = {name: s["detail"] for name, s in stages.items() if s["status"] == "SKIPPED"}
    assert {"train-1.3b", "train-1.3b-eager", "string-prefill-32k", "pretrain-bf16"} <= set(skipped)
    assert all(detail for detail in skipped.values())
    out = capsys.readouterr().out
    assert "4 passed, 0 failed, 13 skipped" in out and "skipped: " in out


def test_a_users_file_named_by_json_is_never_overwritten(tmp_path, capsys):
    """--json names the report's path: a file there that an earlier gpu-check did not write is left untouched."""
    mine = tmp_path / "results.json"
    mine.write_text('{"mine": true}\n')
    assert gpu_check.main(["--out", str(tmp_path / "work"), "--json", str(mine)]) == 2
    assert "is not an earlier gpu-check report" in capsys.readouterr().err
    assert mine.read_text() == '{"mine": true}\n' and not (tmp_path / "work").exists()
    earlier = {"date": "d", "device": "cpu", "torch": "t", "seconds": 1.0, "stages": []}
    mine.write_text(json.dumps(earlier))
    assert gpu_check.is_report_or_new(mine) and gpu_check.is_report_or_new(tmp_path / "new.json")


@pytest.mark.slow  # two 135M models
def test_the_prefill_stage_runs_end_to_end_at_a_small_length_on_cpu(tmp_path):
    """The 32K prefill stage only runs where a GPU is lent: its code runs here at 64 tokens, profile included,
    so a GPU's few minutes are not lost to a Python error."""
    import torch

    line = gpu_check.prefill_stage(torch.device("cpu"), length=64, profile=tmp_path / "p.txt")
    for row in ("posfreq rope", "string", "rope on sdpa", "transformers sdpa", "STRING"):
        assert f"{row} " in line
    assert line.count("ms") == 5 and line.count("x)") == 2
    titles = [
        line[3:] for line in (tmp_path / "p.txt").read_text().splitlines() if line.startswith("== ")
    ]
    assert titles == [
        "posfreq string",
        "posfreq rope",
        "posfreq rope on sdpa",
        "transformers sdpa",
        "transformers STRING",
    ]
