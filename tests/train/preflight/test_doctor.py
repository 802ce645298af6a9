"""`posfreq doctor`: on a machine without a GPU, the CPU subset passes and every GPU check says why it was skipped."""

from __future__ import annotations

import json

import pytest

from posfreq.scripts.commands import doctor
from posfreq.train.preflight.checks import run_check
from posfreq.train.preflight.doctor import prepare_out

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CPU_CHECKS = {
    "environment",
    "pretrain-bf16",
    "pretrain-fp32",
    "attention-flex",
    "probe-flex",
    "loss",
    "string-hf",
}


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
@pytest.mark.e2e  # every doctor check, pretraining in subprocesses
def test_cpu_subset_passes_and_gpu_checks_are_skipped_with_a_reason(tmp_path, capsys, monkeypatch):
    from posfreq.train import devices

    monkeypatch.setattr(
        devices, "nvidia_driver", lambda: None
    )  # hermetic on a GPU node's CPU torch too
    assert doctor.main(["--out", str(tmp_path / "doc"), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "doc/doctor.json").read_text())
    status = {c["name"]: c for c in report["checks"]}
    assert {n for n, c in status.items() if c["status"] == "PASS"} == CPU_CHECKS
    skipped = {n: c["detail"] for n, c in status.items() if c["status"] == "SKIPPED"}
    assert set(skipped) == {
        "attention-varlen",
        "attention-flash",
        "attention-xformers",
        "probe-varlen",
        "probe-flash",
        "probe-xformers",
    }
    assert all("cuda" in why or "GPU" in why for why in skipped.values()), skipped
    assert "histograms equal" in status["pretrain-fp32"]["detail"]
    assert all(c["seconds"] >= 0 for c in report["checks"])
    table = capsys.readouterr().out
    assert "7 passed, 0 failed, 6 skipped" in table and "pretrain-fp32       PASS" in table
    assert "backends ['sdpa/bfloat16']" in status["string-hf"]["detail"]  # one dtype under autocast
    # A second run's claim takes the folder back, its own runs removed (what a second run would replace)
    again = prepare_out(str(tmp_path / "doc"))
    assert not any((again / part).exists() for part in ("data", "pretrain-bf16", "pretrain-fp32"))


def test_a_directory_of_someone_else_is_refused_untouched(tmp_path):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "paper.tex").write_text("draft")
    with pytest.raises(SystemExit, match="holds files `posfreq doctor` did not write"):
        doctor.main(["--out", str(mine)])
    assert [p.name for p in mine.iterdir()] == ["paper.tex"] and (
        mine / "paper.tex"
    ).read_text() == "draft"


def test_a_failing_check_is_a_fail_row_not_a_crash(tmp_path):
    import torch

    def broken() -> str:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")

    row = run_check("attention-x", broken, torch.device("cpu"))
    assert (
        row.status == "FAIL"
        and row.detail == "RuntimeError: FlashAttention only support fp16 and bf16 data type"
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="no CUDA GPU on this machine"
)
def test_on_a_gpu_node_every_check_passes_or_says_why_it_was_skipped(tmp_path):
    """The GPU checks themselves (NCCL pretraining and resume on every local GPU, each kernel, the probe, liger)."""
    assert doctor.main(["--out", str(tmp_path / "doc"), "--device", "cuda"]) == 0
    report = json.loads((tmp_path / "doc/doctor.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status["pretrain-bf16"] == status["pretrain-fp32"] == "PASS"
    assert (
        status["attention-varlen"] == "PASS"
    )  # torch's own kernel: on every sm80+ GPU with a CUDA torch


def test_a_rerun_removes_only_what_the_doctor_and_its_runs_wrote(tmp_path):
    """`doctor --out` deleted data/, pretrain-bf16/ and pretrain-fp32/ whole: now only what its journal (and the
    journals of the runs it started there) records goes, and a part holding a user's file is refused."""
    from posfreq.train.atomic import write_text_atomic
    from posfreq.train.outdir import OutputDirError, claim_output_dir
    from posfreq.train.preflight.doctor import claim_work_dir

    out = claim_work_dir(str(tmp_path / "doc"), "doctor", ("data", "pretrain-bf16"))
    data = claim_output_dir(out / "data", "prepare")  # as the doctor's prepare stage claims it
    write_text_atomic(data / "shard.bin", "tokens")
    again = claim_work_dir(str(out), "doctor", ("data", "pretrain-bf16"))
    assert again == out and not (out / "data").exists()  # the doctor's own run: removed whole
    mine = out / "pretrain-bf16"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")  # never written by posfreq
    with pytest.raises(OutputDirError, match="did not write"):
        claim_work_dir(str(out), "doctor", ("data", "pretrain-bf16"))
    assert (mine / "notes.txt").read_text() == "mine"
