"""The lm-evaluation-harness NIAH task (analysis/lm_eval_task) scores a model exactly as posfreq's probe does.

End to end: a tiny bytes-tokenizer checkpoint is probed by analysis/probe.py (our model, our
decoding) and, exported to Hugging Face format, evaluated by lm-eval offline (transformers'
model, lm-eval's greedy decoding) on the same tests; every test's prompt, answer and scores agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.hf import consolidated_bytes_model

from posfreq.analysis.lm_eval_task import make_tests, scoring
from posfreq.train.model.config import ModelConfig

LENGTHS = (480, 560)  # the bytes tokenizer's shortest test with a 40-token budget is about 470
TESTS = 3
BUDGET = 40
NEEDLES = ("111111", "222222", "333333", "444444")


def write_checkpoint(directory: Path) -> Path:
    """A random 1-layer bytes-tokenizer model as a consolidated checkpoint; weights large enough for clear argmaxes."""
    config = ModelConfig(
        vocab_size=258, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, train_len=1024
    )
    consolidated_bytes_model(directory, config, weight_std=0.3)
    return directory


def run_lm_eval(model_dir: Path, task_dir: Path) -> dict:
    """lm-eval's hf model on CPU, greedy, over the generated task; per-test samples logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=[make_tests.GROUP],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        device="cpu",
        batch_size=1,
        log_samples=True,
    )


@pytest.mark.slow  # a subprocess or a training run
def test_lm_eval_scores_each_test_as_the_probe(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("lm_eval", reason="the lmeval extra: pip install -e '.[lmeval]'")
    import datasets

    from posfreq.analysis.niah import store
    from posfreq.scripts.commands import export_hf, probe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    export_hf.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")])
    lengths = ",".join(map(str, LENGTHS))
    settings = [
        "--lengths",
        lengths,
        "--tests-per-length",
        str(TESTS),
        "--max-new-tokens",
        str(BUDGET),
    ]
    assert (
        make_tests.main(
            ["--tokenizer", f"hf:{tmp_path / 'hf'}", "--out", str(tmp_path / "task"), *settings]
        )
        == 0
    )
    assert (
        probe.main(
            [
                "--checkpoint",
                str(checkpoint),
                "--out",
                str(tmp_path / "probe"),
                "--teacher-forced",
                "false",
                "--no-figures",
                "--quiet",
                "--threads",
                "1",
                *settings,
            ]
        )
        == 0
    )
    expected = {
        (r["length"], r["index"]): r for r in store.read_records(tmp_path / "probe", LENGTHS)
    }

    out = run_lm_eval(tmp_path / "hf", tmp_path / "task")
    samples = [s for task in out["samples"].values() for s in task]
    assert sorted((s["doc"]["length"], s["doc"]["index"]) for s in samples) == sorted(expected)
    for sample in samples:
        doc, reference = sample["doc"], expected[(sample["doc"]["length"], sample["doc"]["index"])]
        assert doc["prompt_sha256"] == reference["prompt_sha256"] and doc["reencodes_exactly"]
        assert sample["arguments"][0][0] == doc["prompt"]  # lm-eval sent the prompt text as stored
        assert (
            sample["filtered_resps"][0] == reference["generated"]
        )  # same greedy answer, token for token
        hits = reference["hits_anywhere"]
        assert sample["passed"] == float(sum(hits) >= 2)
        assert sample["needle_recall"] == sum(hits) / 4
        assert sample["all_needles"] == float(all(hits))
    for length in LENGTHS:
        assert out["results"][f"{make_tests.GROUP}_{length}"]["passed,none"] == pytest.approx(
            sum(sum(r["hits_anywhere"]) >= 2 for k, r in expected.items() if k[0] == length) / TESTS
        )


def doc(min_retrieved: int = 2, scoring_rule: str = "anywhere") -> dict:
    """A JSONL record with known needles, as make_tests writes it (only what scoring reads)."""
    return {
        "prompt": "… One of the magic numbers is 111111. …\nThe numbers are",
        "needles": list(NEEDLES),
        "length": 480,
        "index": 0,
        "depths": [0.1, 0.3, 0.6, 0.9],
        "distances": [400, 300, 200, 50],
        "min_retrieved": min_retrieved,
        "scoring": scoring_rule,
    }


@pytest.mark.parametrize(
    "answer, passed, recall",
    [
        (" 111111, 222222, 333333 and 444444.", 1.0, 1.0),
        (" 222222 and 999999.", 0.0, 0.25),
        (" 1. 111111\n2. 333333", 1.0, 0.5),
        (" 1111112, 222222", 0.0, 0.25),  # a 7-digit run holds no needle
        ("", 0.0, 0.0),
    ],
)
def test_scores_by_hand(answer: str, passed: float, recall: float) -> None:
    scores = scoring.process_results(doc(), [answer])
    assert (scores["passed"], scores["needle_recall"], scores["all_needles"]) == (
        passed,
        recall,
        float(recall == 1.0),
    )


def test_answer_cut_where_the_probe_stops() -> None:
    """The probe stops once all four needles appeared, so digits generated after the last one never spoil it."""
    answer = " 111111, 222222, 333333 and 4444449 and more"
    assert scoring.probe_answer(NEEDLES, answer) == " 111111, 222222, 333333 and 444444"
    assert scoring.process_results(doc(), [answer])["all_needles"] == 1.0
    assert (
        scoring.probe_answer(NEEDLES, " 111111 then 2222229") == " 111111 then 2222229"
    )  # never all four: kept whole


def test_first_line_rule_and_threshold() -> None:
    answer = " 111111\n222222, 333333"
    assert (
        scoring.process_results(doc(scoring_rule="first_line"), [answer])["needle_recall"] == 0.25
    )
    assert scoring.process_results(doc(min_retrieved=3), [answer])["passed"] == 1.0
    assert scoring.process_results(doc(min_retrieved=4), [answer])["passed"] == 0.0


def test_task_files(tmp_path: Path) -> None:
    """One JSONL and task per length, each with the answer budget as max_gen_toks, and a group over them."""
    import yaml

    assert (
        make_tests.main(
            [
                "--tokenizer",
                "bytes",
                "--lengths",
                "480:560:80",
                "--tests-per-length",
                "2",
                "--max-new-tokens",
                "40",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    group = yaml.safe_load((tmp_path / "posfreq_niah_group.yaml").read_text())
    assert group["group"] == "posfreq_niah" and group["task"] == [
        "posfreq_niah_480",
        "posfreq_niah_560",
    ]
    for length in LENGTHS:
        task = yaml.safe_load((tmp_path / f"posfreq_niah_{length}.yaml").read_text())
        assert task["generation_kwargs"]["max_gen_toks"] == 40 and Path(task["include"]).is_file()
        records = [
            json.loads(line)
            for line in Path(task["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()
        ]
        assert [r["index"] for r in records] == [0, 1]
        for r in records:
            assert (
                len(r["prompt"].encode("utf-8")) == length - 40
            )  # bytes: one token per byte, no BOS
            assert r["prompt"].endswith("\nThe numbers are") and all(
                r["prompt"].count(n) == 1 for n in r["needles"]
            )
            assert r["reencodes_exactly"] and not r["bos"]
