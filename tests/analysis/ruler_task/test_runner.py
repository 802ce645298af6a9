"""RULER's synthetic tasks offline (analysis/ruler_task, `posfreq ruler`): lm-eval's own samples,
no network, a metric from every task.

The samples are checked against lm-eval's RULER task functions run on the same haystack and seed
(so the task table matches lm-eval's), the haystack against the essay files' words, and the whole
command end to end on a tiny Llama-3-tokenizer model with every socket refused.
"""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lmeval extra: pip install -e '.[lmeval]'")
pytest.importorskip("wonderwords", reason="lm-eval's ruler extra: pip install -e '.[lmeval]'")

from helpers.hf import consolidated_bytes_model  # noqa: E402

from posfreq.train.data.essays import pg_essays_dir  # noqa: E402
from posfreq.train.model.config import ModelConfig  # noqa: E402

LENGTH = 1024


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory) -> Path:
    """A random 1-layer model with the Llama-3 tokenizer, exported for transformers (config,
    safetensors, tokenizer.json), trained length LENGTH."""
    from posfreq.scripts.commands import export_hf

    root = tmp_path_factory.mktemp("ruler-model")
    config = ModelConfig(
        vocab_size=128256,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=32,
        train_len=LENGTH,
    )
    consolidated_bytes_model(root / "ckpt", config, weight_std=0.3)
    spec = {"spec": "llama3", "vocab_size": 128256, "bos_id": 128000, "eos_id": 128001}
    (root / "ckpt" / "tokenizer_spec.json").write_text(json.dumps(spec))
    assert export_hf.main(["--checkpoint", str(root / "ckpt"), "--out", str(root / "hf")]) == 0
    return root / "hf"


def test_essay_haystack_is_the_shipped_essays_words() -> None:
    from posfreq.analysis.ruler_task.offline import essay_haystack

    words = [w for path in sorted(pg_essays_dir().glob("*.txt")) for w in path.read_text().split()]
    assert essay_haystack() == words


@pytest.mark.slow
def test_sentence_model_splits_the_haystack_without_losing_a_word() -> None:
    from posfreq.analysis.ruler_task.offline import essay_text, use_offline_data

    use_offline_data()
    from nltk import sent_tokenize

    text = essay_text()[:200_000]
    sentences = sent_tokenize(text)
    assert len(sentences) > 500  # split into sentences, not returned whole
    assert "".join(sentences).replace(" ", "") == text.replace(" ", "")  # every character, in order


@pytest.mark.slow  # lm-eval's generators make 500 samples per task
@pytest.mark.parametrize(
    "task, reference",
    [
        ("niah_single_1", "niah_single_1"),
        ("niah_single_2", "niah_single_2"),
        ("niah_single_3", "niah_single_3"),
        ("niah_multikey_1", "niah_multikey_1"),
        ("niah_multikey_2", "niah_multikey_2"),
        ("niah_multikey_3", "niah_multikey_3"),
        ("niah_multivalue", "niah_multivalue"),
        ("niah_multiquery", "niah_multiquery"),
        ("vt", "get_vt_dataset"),
        ("fwe", "fwe_download"),
        ("cwe", "get_cw_dataset"),
    ],
)
def test_samples_are_lm_evals_own(
    llama3_model: Path, monkeypatch, task: str, reference: str
) -> None:
    """Our first samples equal lm-eval's task function's under the same seed, its essay download
    replaced by the shipped essays: the parameter table is lm-eval's."""
    from lm_eval.tasks.ruler import cwe_utils, fwe_utils, niah_utils, vt_utils

    from posfreq.analysis.ruler_task import tasks
    from posfreq.analysis.ruler_task.offline import essay_haystack

    module = {"vt": vt_utils, "fwe": fwe_utils, "cwe": cwe_utils}.get(task, niah_utils)
    real_haystack = niah_utils.get_haystack
    monkeypatch.setattr(
        niah_utils,
        "get_haystack",
        lambda type_haystack: (
            essay_haystack() if type_haystack == "essay" else real_haystack(type_haystack)
        ),
    )
    with tasks.seeded(f"{task}:{LENGTH}"):
        theirs = getattr(module, reference)(tokenizer=str(llama3_model), max_seq_lengths=[LENGTH])
    tokenizer = tasks.common_utils.get_tokenizer(str(llama3_model))
    ours = tasks.samples_for(task, tokenizer, LENGTH, 3)
    assert len(ours) == 3
    for mine, their in zip(ours, theirs["test"]):
        assert {key: mine[key] for key in their} == dict(their)


@pytest.mark.slow
def test_a_task_seeds_itself(llama3_model: Path) -> None:
    from posfreq.analysis.ruler_task import tasks

    tokenizer = tasks.common_utils.get_tokenizer(str(llama3_model))
    first = tasks.samples_for("niah_single_2", tokenizer, LENGTH, 2)
    random.random()  # what ran before must not matter
    state = random.getstate()
    again = tasks.samples_for("niah_single_2", tokenizer, LENGTH, 2)
    assert again == first
    assert random.getstate() == state  # and the caller's random stream is left as it was
    assert all(row["length"] <= LENGTH and row["max_length"] == LENGTH for row in first)
    assert all(row["outputs"][0] in row["input"] for row in first)


@pytest.mark.slow  # lm-eval's import alone takes about 12 s
def test_a_length_too_short_is_refused_by_name(llama3_model: Path) -> None:
    from posfreq.analysis.ruler_task import tasks

    tokenizer = tasks.common_utils.get_tokenizer(str(llama3_model))
    with pytest.raises(ValueError, match="RULER's cwe does not fit in 300 tokens.*Fix"):
        tasks.samples_for("cwe", tokenizer, 300, 1)
    with pytest.raises(ValueError, match="essay haystack .* too few for 1000000-token prompts"):
        tasks.samples_for("niah_single_2", tokenizer, 1_000_000, 1)


NO_NETWORK = """
import socket, sys

def refuse(*args, **kwargs):
    print("NETWORK ATTEMPT", args[:2], file=sys.stderr, flush=True)
    raise OSError("network access attempted (refused by the test)")

socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse
"""
"""Prepended to a fresh interpreter's script: every connection and name lookup fails and is reported."""


def run_without_network(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """`script` in a new Python process whose sockets refuse to connect (imports included)."""
    return subprocess.run(
        [sys.executable, "-c", NO_NETWORK + script], cwd=cwd, capture_output=True, text=True
    )


def test_the_network_refusal_double_refuses(tmp_path: Path) -> None:
    done = run_without_network(
        "import urllib.request; urllib.request.urlopen('https://pypi.org')", tmp_path
    )
    assert done.returncode != 0 and "NETWORK ATTEMPT" in done.stderr


@pytest.mark.slow  # eleven tasks through lm-eval and transformers, in a fresh process
@pytest.mark.e2e  # the eleven RULER tasks through lm-eval in a fresh process
def test_all_eleven_tasks_run_offline_and_score(llama3_model: Path, tmp_path: Path) -> None:
    from posfreq.analysis.ruler_task import runner as ruler

    pg_essays_dir()  # the one-time asset fetch (as `make setup` does), before the network goes
    out = tmp_path / "ruler"
    argv = [
        "--model",
        f"hf:{llama3_model}",
        "--samples",
        "1",
        "--out",
        str(out),
        "--positions",
        "string",
    ]
    done = run_without_network(
        f"import sys; from posfreq.scripts.commands import ruler; sys.exit(ruler.main({argv!r}))",
        tmp_path,
    )
    assert "NETWORK ATTEMPT" not in done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    # lm-eval's notices, progress bars and generators' prints go to the log, not the terminal
    printed = done.stdout + done.stderr
    assert "Custom kwargs" not in printed and "Running generate_until" not in printed
    assert "Custom kwargs" in (out / "ruler.log").read_text()
    rows = list(csv.DictReader(open(out / "scores.csv")))
    assert [row["task"] for row in rows] == [*ruler.TASKS, "mean"]
    for row in rows:
        assert row["length"] == str(LENGTH)
        assert 0.0 <= float(row["score"]) <= 1.0
        assert row["positions"] == "string"
        assert json.loads(row["position_options"]) == {"shift": 341, "window": 128}
    assert [row["samples"] for row in rows] == ["1"] * len(ruler.TASKS) + [str(len(ruler.TASKS))]
    results = json.loads((out / "results.json").read_text())["results"]
    for task in ruler.TASKS:
        assert f"{LENGTH},none" in results[f"posfreq_ruler_{task}"]


@pytest.mark.slow
def test_refusals_name_the_input_and_the_fix(tmp_path: Path, llama3_model: Path, capsys) -> None:
    from posfreq.scripts.commands import ruler as ruler_command

    assert ruler_command.main(["--model", f"hf:{tmp_path}"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert ruler_command.main(["--model", f"hf:{llama3_model}", "--tasks", "vt,qa_squad"]) == 1
    assert "unknown ['qa_squad']" in capsys.readouterr().err
    assert ruler_command.main(["--model", f"hf:{llama3_model}", "--chat-template", "true"]) == 1
    assert "has no chat template" in capsys.readouterr().err
    assert ruler_command.main(["--model", f"hf:{llama3_model}", "--lengths", "4096:1024:1024"]) == 1
    assert "gives no positive lengths" in capsys.readouterr().err
    string = ["--positions", "string", "--shift", "100", "--window", "100"]
    assert ruler_command.main(["--model", f"hf:{llama3_model}", *string]) == 1
    assert "need 0 <= window < shift" in capsys.readouterr().err
    short = ["--tasks", "niah_single_1,cwe", "--lengths", "300,2048", "--out", str(tmp_path / "s")]
    assert ruler_command.main(["--model", f"hf:{llama3_model}", *short]) == 1
    err = capsys.readouterr().err  # every misfit at once, before any task is evaluated
    assert "nothing was evaluated" in err and "cwe at 300: RULER's cwe does not fit" in err
    assert "niah_single_1 at" not in err and not (tmp_path / "s").exists()
    dca = ["--positions", "dca", "--position-options", '{"group": 2}']
    assert ruler_command.main(["--model", f"hf:{llama3_model}", *dca]) == 1
    assert "dca does not take ['group']" in capsys.readouterr().err
    assert ruler_command.main(["--model", f"hf:{llama3_model}", "--lengths", "4k"]) == 1
    assert "Fix: e.g. --lengths 4096,8192" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert ruler_command.main(["--model", f"hf:{llama3_model}", "--device", "cuda"]) == 1
        assert "torch sees no CUDA GPU" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "paper.tex").write_text("keep")
    assert ruler_command.main(["--model", f"hf:{llama3_model}", "--out", str(mine)]) == 1
    assert "did not write (paper.tex)" in capsys.readouterr().err
    assert (mine / "paper.tex").read_text() == "keep"


@pytest.mark.slow  # three small lm-eval runs
def test_string_through_lm_evals_own_model_loader_is_posfreq_rulers(
    llama3_model: Path, tmp_path: Path
) -> None:
    """docs/ruler.md's Python route (lm-eval's hf model with attn_implementation=posfreq_string) gives
    the answers `posfreq ruler --positions string` gives, and they are not rope's."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import posfreq.train.positions.string_hf  # noqa: F401  (registers posfreq_string)
    from posfreq.analysis.ruler_task import runner as ruler
    from posfreq.scripts.commands import ruler as ruler_command

    def wrapper_answers(positions: str) -> list[str]:
        out = tmp_path / positions
        argv = ["--model", f"hf:{llama3_model}", "--tasks", "niah_single_2", "--samples", "3"]
        assert (
            ruler_command.main(
                [*argv, "--positions", positions, "--out", str(out), "--log-samples", "true"]
            )
            == 0
        )
        lines = (out / "samples_posfreq_ruler_niah_single_2.jsonl").read_text().splitlines()
        return [json.loads(line)["resps"][0][0] for line in lines]

    evaluation = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={llama3_model},dtype=float32,attn_implementation=posfreq_string",
        tasks=["posfreq_ruler_niah_single_2"],
        task_manager=TaskManager(
            include_path=str(ruler.TASK_DIR),
            include_defaults=False,
            metadata={
                "pretrained": str(llama3_model),
                "max_seq_lengths": [LENGTH],
                "num_samples": 3,
            },
        ),
        device="cpu",
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
    )
    direct = [
        entry["resps"][0][0] for entry in evaluation["samples"]["posfreq_ruler_niah_single_2"]
    ]
    string = wrapper_answers("string")
    assert direct == string
    assert string != wrapper_answers("rope")


@pytest.mark.slow  # four small lm-eval runs
def test_a_rerun_evaluates_only_what_is_missing_or_damaged(
    llama3_model: Path, tmp_path: Path, monkeypatch
) -> None:
    from posfreq.analysis.ruler_task import runner as ruler
    from posfreq.scripts.commands import ruler as ruler_command

    evaluated, loaded = [], []
    evaluate, load = ruler.Evaluator.evaluate, ruler.Evaluator.load
    monkeypatch.setattr(
        ruler.Evaluator,
        "evaluate",
        lambda self, task, length: evaluated.append(task) or evaluate(self, task, length),
    )
    monkeypatch.setattr(ruler.Evaluator, "load", lambda self: loaded.append(1) or load(self))
    out = tmp_path / "ruler"
    argv = ["--model", f"hf:{llama3_model}", "--tasks", "niah_single_1,vt", "--out", str(out)]

    def scores(*extra: str) -> str:
        evaluated.clear()
        loaded.clear()
        assert ruler_command.main([*argv, "--samples", "1", *extra]) == 0
        return (out / "scores.csv").read_text()

    first = scores()
    assert evaluated == ["niah_single_1", "vt"] and loaded == [1]
    assert scores() == first and evaluated == [] and loaded == []  # nothing to do, no model loaded
    (part,) = (out / "parts").glob(f"vt-L{LENGTH}-*.json")
    part.unlink()  # as if killed during vt
    (part,) = (out / "parts").glob(f"niah_single_1-L{LENGTH}-*.json")
    part.write_text("{")  # torn
    assert scores() == first and evaluated == ["niah_single_1", "vt"]


def test_a_unit_key_changes_with_every_setting_it_holds() -> None:
    from posfreq.analysis.keys import ruler_unit_key

    request = {"model": "m", "positions": "rope", "shift": None, "samples": 1, "device": "cpu"}
    key = ruler_unit_key(request, "vt", 1024)
    changed = [
        ruler_unit_key({**request, "positions": "string"}, "vt", 1024),
        ruler_unit_key({**request, "samples": 2}, "vt", 1024),
        ruler_unit_key({**request, "device": "cuda"}, "vt", 1024),
        ruler_unit_key({**request, "model": "m2"}, "vt", 1024),
        ruler_unit_key(request, "cwe", 1024),
        ruler_unit_key(request, "vt", 2048),
    ]
    assert key not in changed and len(set(changed)) == len(changed)


@pytest.mark.slow
def test_a_changed_model_file_is_another_model(llama3_model: Path, tmp_path: Path) -> None:
    import shutil

    from posfreq.analysis.ruler_task import runner as ruler

    copy = tmp_path / "model"
    shutil.copytree(llama3_model, copy)
    before = ruler.model_fingerprint(copy)
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert ruler.model_fingerprint(copy) != before


def test_the_code_key_covers_what_decides_a_score_and_not_the_command_line() -> None:
    from posfreq.analysis.keys import RULER_ENTRIES
    from posfreq.analysis.ruler_task import runner as ruler
    from posfreq.train.fingerprint import import_closure

    covered = import_closure(RULER_ENTRIES, ())
    for decides in (
        "train/positions/string.py",
        "train/positions/merge.py",
        "train/data/essays.py",
    ):
        assert decides in covered
    assert "scripts/commands/ruler.py" not in covered  # its tables and keys do not change a score
    assert "analysis/ruler_task/posfreq_ruler_vt.yaml" in ruler.task_yamls()
    assert {"nltk", "wonderwords", "lm_eval"} <= set(ruler.code_fingerprint())


def plant_code(model: Path, into: Path, marker: Path) -> Path:
    """A copy of `model` whose tokenizer_config.json names a class of the folder's own evil.py (which would
    leave `marker` when imported)."""
    import shutil

    shutil.copytree(model, into)
    config = into / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.is_file() else {}
    data["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(data))
    (into / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    return into


def test_a_model_folder_that_names_its_own_code_is_refused_before_anything_loads(
    tmp_path: Path, capsys
) -> None:
    """lm-eval's RULER loader trusts remote code: an auto_map folder would run its evil.py (issue 30)."""
    from posfreq.scripts.commands import ruler as ruler_command
    from posfreq.train.model.hf_folder import ModelFolderError
    from posfreq.train.positions.hf_schemes import load_causal_lm

    marker = tmp_path / "marker"
    # No weights needed: the folder is refused before anything is read from it.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": LENGTH})
    )
    model = plant_code(plain, tmp_path / "evil-model", marker)
    argv = ["--model", f"hf:{model}", "--tasks", "niah_single_1", "--lengths", "1024"]
    assert ruler_command.main([*argv, "--samples", "1", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "tokenizer_config.json: auto_map" in err and "posfreq runs no code" in err
    assert err.count("\n") == 1 and not (tmp_path / "r").exists()
    with pytest.raises(ModelFolderError, match="auto_map"):
        load_causal_lm(model)
    assert not marker.exists()


@pytest.mark.slow
def test_the_key_holds_the_essays_and_the_sentence_model_by_content(tmp_path, monkeypatch) -> None:
    """ruler's part keys ignored the essays and Punkt caches: a changed cache reused parts made from another."""
    import shutil

    from posfreq.analysis.keys import ruler_unit_key
    from posfreq.analysis.ruler_task import runner as ruler
    from posfreq.analysis.ruler_task.offline import PUNKT_LANGUAGE, nltk_data_dir

    shutil.copytree(pg_essays_dir(), tmp_path / "cache" / "pg_essays")
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    before = ruler.data_fingerprint()
    model = nltk_data_dir() / "tokenizers" / "punkt_tab" / PUNKT_LANGUAGE
    with open(model / "abbrev_types.txt", "a", encoding="utf-8") as f:
        f.write("planted\n")
    after = ruler.data_fingerprint()
    assert before["essays"] == after["essays"] and before["punkt"] != after["punkt"]
    request = {"model": "m", "data": before}
    assert ruler_unit_key(request, "vt", 1024) != ruler_unit_key(
        {**request, "data": after}, "vt", 1024
    )


@pytest.mark.slow  # one small lm-eval run
def test_logits_that_overflow_stop_ruler_naming_the_model_the_task_and_the_length(
    llama3_model: Path, tmp_path: Path, capsys
) -> None:
    """lm-eval argmaxes and scores whatever the head returns: logits that overflow to infinity made answers and
    scores of them. The head's output is checked, and the command stops with one line naming the model, the task
    and the length."""
    import shutil

    from safetensors.torch import load_file, save_file

    from posfreq.scripts.commands import ruler as ruler_command

    model = tmp_path / "m"
    shutil.copytree(llama3_model, model)
    weights = load_file(str(model / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head] = weights[head].clone().fill_(3e38)  # finite weights, infinite logits
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    argv = ["--model", f"hf:{model}", "--tasks", "niah_single_1", "--samples", "1"]
    capsys.readouterr()
    assert ruler_command.main([*argv, "--out", str(tmp_path / "ruler")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    message = errors[0]
    assert "non-finite logits at the model's output head" in message, message
    assert f"in task niah_single_1 at length {LENGTH}" in message and str(model) in message
    assert "Fix: run with --dtype float32" in message
