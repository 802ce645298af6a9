"""make gpu-check (train/preflight/gpu_check.py) without a GPU: what a CPU runs passes, every GPU stage is named as skipped
with its reason, and a stage past its budget fails even if it catches every Exception."""

from __future__ import annotations

import json
import time

import pytest

from posfreq.train.preflight import gpu_check, gpu_kernels, gpu_training


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
    monkeypatch.setattr(gpu_kernels, "nvidia_driver", lambda: None)
    report = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(tmp_path / "work"), "--json", str(report)]) == 0
    stages = {s["name"]: s for s in json.loads(report.read_text())["stages"]}
    ran = {name for name, s in stages.items() if s["status"] == "PASS"}
    assert ran == {"environment", "attention-flex", "loss", "string-hf"}
    skipped = {name: s["detail"] for name, s in stages.items() if s["status"] == "SKIPPED"}
    assert {
        "train-1.3b",
        "string-prefill-32k",
        "slurm-requeue",
        "varlen-repeatable",
        "varlen-native-gqa",
    } <= set(skipped)
    assert not {"train-1.3b-eager", "pretrain-bf16", "block-compile"} & set(stages)  # by name only
    assert all(detail for detail in skipped.values())
    out = capsys.readouterr().out
    assert "4 passed, 0 failed, 12 skipped" in out and "skipped: " in out


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
@pytest.mark.e2e  # a stage of gpu-check end to end
def test_the_prefill_stage_runs_end_to_end_at_a_small_length_on_cpu(tmp_path):
    """The 32K prefill stage only runs where a GPU is lent: its code runs here at 64 tokens, profile included,
    so a GPU's few minutes are not lost to a Python error."""
    import torch

    line = gpu_kernels.prefill_stage(torch.device("cpu"), length=64, profile=tmp_path / "p.txt")
    import re

    ms = {name.strip(): int(value) for name, value in re.findall(r"([A-Za-z ]+?) (\d+) ms", line)}
    assert set(ms) == {
        "posfreq rope",
        "rope on sdpa",
        "string",
        "transformers sdpa",
        "STRING",
    }, line
    # the ratios are against the fastest RoPE path, whichever it is (times rounded to ms: compared loosely)
    fastest = re.search(r"fastest RoPE: (posfreq rope sdpa|posfreq rope|transformers sdpa);", line)
    assert fastest, line
    shown = {"posfreq rope": "posfreq rope", "posfreq rope sdpa": "rope on sdpa"}.get(
        fastest.group(1), fastest.group(1)
    )
    assert ms[shown] == min(ms["posfreq rope"], ms["rope on sdpa"], ms["transformers sdpa"]), line
    assert "(goal <= 1.10x)" in line and line.count("x it") == 2
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


@pytest.mark.slow
def test_one_run_fits_its_minutes_and_names_what_it_had_no_time_for(tmp_path, monkeypatch):
    """The plain run's stages share RUN_SECONDS: a stage gets what is left at most, one not started in time is
    SKIPPED naming why, and a stage outside the plain run runs only when --only names it."""
    import torch

    ran = []

    def stage(name: str, seconds: float):
        def body() -> str:
            ran.append(name)
            time.sleep(seconds)
            return name

        return body

    fake = [
        ("first", 60, stage("first", 0.3), True),
        ("slow", 60, stage("slow", 8.0), True),  # cut at what is left of the run, not its own 60 s
        ("late", 60, stage("late", 0.0), True),
        ("extra", 60, stage("extra", 0.0), False),
    ]
    monkeypatch.setattr(gpu_check, "stages", lambda device, out: fake)
    monkeypatch.setattr(gpu_check, "RUN_SECONDS", 6.2)
    started = time.perf_counter()
    results = gpu_check.run_stages(torch.device("cpu"), tmp_path, tmp_path / "r.json", None)
    assert time.perf_counter() - started < 9
    status = {r.name: (r.status, r.detail) for r in results}
    assert status["first"] == ("PASS", "first")
    assert status["slow"][0] == "FAIL" and "over its budget" in status["slow"][1]
    assert status["late"] == ("SKIPPED", "the run's 6.2 s were spent before it")
    assert "extra" not in status and ran == ["first", "slow"]
    results = gpu_check.run_stages(torch.device("cpu"), tmp_path, tmp_path / "r.json", {"extra"})
    assert [(r.name, r.status) for r in results] == [("extra", "PASS")]


def test_the_repeatability_stage_tells_a_repeatable_backward_from_one_that_is_not(monkeypatch):
    """On the CPU's sdpa the same packed inputs give the same gradients; a kernel whose backward differs
    between two identical calls (atomics) is reported as not repeatable, with how many values differ."""
    import torch

    from posfreq.train.model import attention

    line = gpu_kernels.varlen_repeatability_stage(
        torch.device("cpu"), rows=2, length=128, backend="sdpa"
    )
    assert line.startswith("sdpa: bitwise repeatable (") and "in 2 x 128 tokens" in line
    calls = []
    real = attention.varlen_attention

    def jittery(q, *args, **kwargs):  # the second call's key gradient moves in the last bit
        calls.append(1)
        out = real(q, *args, **kwargs)
        return out * (1 + 1e-6 * (len(calls) == 2))

    monkeypatch.setattr(attention, "varlen_attention", jittery)
    line = gpu_kernels.varlen_repeatability_stage(
        torch.device("cpu"), rows=2, length=128, backend="sdpa"
    )
    assert "NOT bitwise repeatable" in line and "dq " in line


@pytest.mark.slow  # three tiny runs in child processes
@pytest.mark.e2e  # a stage of gpu-check end to end
def test_the_slurm_stage_runs_on_cpu_under_gloo(tmp_path):
    """The slurm-requeue stage only runs where a GPU is lent (NCCL): its code runs here over gloo, so a GPU's
    minutes are not lost to a Python error. One task under SLURMEnvironment, SIGUSR1, `scontrol requeue` asked
    of the fake, the requeued job's losses equal the uninterrupted run's."""
    import torch

    from posfreq.train.preflight.pretrain_check import requeue_check, write_tiny_corpus

    data = write_tiny_corpus(tmp_path / "data")
    line = requeue_check(tmp_path / "work", data, torch.device("cpu"), "32-true")
    assert line.startswith("SLURMEnvironment, gloo, 32-true: SIGUSR1 during step 2")
    assert "max relative difference 0.0e+00" in line
    assert (tmp_path / "work" / "scontrol.calls").read_text() == "requeue 4242\n"


@pytest.mark.slow  # the trainer twice, on a tiny model
def test_the_training_stage_runs_its_accumulation_save_and_resume_on_cpu(tmp_path):
    """The 1.3B stage's code on a tiny model: a step of several micro-batches, a stop with a sharded save at step
    2, a resume to step 4, and the figures it reports (save and load timed, MFU against the measured matmul)."""
    import torch

    size = gpu_training.TrainStageSize(
        preset="tiny-2l-128",
        length=64,
        micro_batches=2,
        matmul_size=64,
        compile="off",
        vocab=512,  # Llama-3's 128,256 logits per token would take minutes a step here
    )
    result = gpu_training.train_stage(torch.device("cpu"), tmp_path, size)
    assert result["save_s"] > 0 and result["load_s"] > 0 and result["step_s"] > 0
    assert 0 < result["mfu_measured"] and result["peak_gib"] is None
    assert "2 x 8 rows x 64 per step" in result["detail"] and "sharded save" in result["detail"]
    assert (tmp_path / "run" / "checkpoints" / "latest").is_dir()
    # the plan's figure for the same run, to read beside the measured peak: the tiny model's, not the 1.3B's
    assert (
        0 < result["planned_gib"] < 1
        and f"(posfreq plan: {result['planned_gib']:.1f} GiB)" in result["detail"]
    )
