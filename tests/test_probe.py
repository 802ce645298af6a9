"""The NIAH probe end to end: fake models with known answers, a real tiny Transformer, run-level
tables against a naive Eq. 2, resumability, and the notebook executed on fixture runs."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis import probe
from analysis.effective_length import RUN_COLUMNS
from analysis.niah import NiahBuilder
from train.checkpoint import FORMAT, milestone_name
from train.config import model_preset
from train.model import Transformer
from train.positions import SCHEMES
from train.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = get_tokenizer("llama3")
NEEDLE_SENTENCE = re.compile(r"One of the magic numbers is (\d{6})\.")


class WindowModel:
    """Answers with the numbers of the needle sentences wholly inside the last `k` prompt tokens (k=None: all)."""

    def __init__(self, tokenizer, k: int | None = None, silent: bool = False) -> None:
        self.tokenizer, self.k, self.silent = tokenizer, k, silent
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompt_ids, max_new_tokens, stop=None):
        self.calls.append(tuple(prompt_ids.shape))
        rows = []
        for ids in prompt_ids.tolist():
            if self.silent:
                rows.append([self.tokenizer.eos_id])
                continue
            seen = ids if self.k is None else ids[-self.k :]
            numbers = NEEDLE_SENTENCE.findall(self.tokenizer.decode(seen))
            answer = " " + ", ".join(numbers) + ".\nExtra text 999999 after the answer line"
            rows.append(self.tokenizer.encode(answer)[:max_new_tokens] + [self.tokenizer.eos_id, 5, 6])
        return rows


def fake_probe(model, name="fake", train_len=512) -> probe.ModelProbe:
    return probe.ModelProbe(model, TOKENIZER, name, train_len)


def job(lengths, tests=6, batch=4, threshold=0.5) -> probe.Job:
    settings = probe.ProbeSettings(tests_per_length=tests, haystack="noise")
    return probe.Job(settings, list(lengths), batch, threshold, torch.device("cpu"), figures=False, show_progress=False)


def run_one(tmp_path, model, lengths, tests=6, **kw) -> tuple[dict, list[dict]]:
    j = job(lengths, tests, **kw)
    builders = probe.Builders("noise")
    row = probe.probe_one(lambda: fake_probe(model), "fake", None, tmp_path, j, builders)
    records = probe.read_records(tmp_path, lengths)
    return row, records


def test_oracle_passes_everything_and_silence_fails_everything(tmp_path):
    row, records = run_one(tmp_path / "oracle", WindowModel(TOKENIZER), [128, 256, 384])
    assert all(r["passed"] and all(r["hits"]) for r in records) and len(records) == 18
    assert "999999" not in "".join(r["answer"] for r in records)  # cut at the answer line
    assert row["effective_length"] == 384 and row["effective_length_status"] == "all_passed"
    row, records = run_one(tmp_path / "silent", WindowModel(TOKENIZER, silent=True), [128, 256])
    assert not any(r["passed"] or any(r["hits"]) for r in records)
    assert row["effective_length"] == 0 and row["effective_length_status"] == "none_passed"
    assert row["f_effective_length"] == ""
    with open(tmp_path / "silent" / "summary.csv") as fh:
        assert [float(r["pass_rate"]) for r in csv.DictReader(fh)] == [0.0, 0.0]


def test_window_model_fails_exactly_for_needles_beyond_k(tmp_path):
    k, lengths = 120, [128, 256, 384, 512, 640]
    row, records = run_one(tmp_path, WindowModel(TOKENIZER, k), lengths, tests=10)
    builder = NiahBuilder(TOKENIZER, "noise")
    expected_rates = []
    for length in lengths:
        tests = builder.make_tests(length, 10, 0)
        mine = [r for r in records if r["length"] == length]
        for test, rec in zip(tests, mine):
            visible = [length - p <= k for p in test.positions]  # needle sentence starts within the last k tokens
            assert rec["hits"] == visible, (length, test.positions)
            assert rec["passed"] == (sum(visible) >= 2)
        expected_rates.append(np.mean([sum(length - p <= k for p in t.positions) >= 2 for t in tests]))
    first_fail = next(i for i, r in enumerate(expected_rates) if r < 0.5)
    assert expected_rates[0] == 1.0 and 0 < first_fail
    assert row["effective_length"] == lengths[first_fail - 1] and row["effective_length_status"] == "ok"
    for length, rate in zip(lengths, expected_rates):
        assert row[f"pass_rate_{length}"] == pytest.approx(rate)


def test_lengths_and_options_parsing():
    assert probe.parse_lengths("128:512:128") == [128, 256, 384, 512]
    assert probe.parse_lengths("512,128") == [128, 512]
    assert probe.parse_option("shift=1365") == ("shift", 1365)
    assert probe.parse_option("mode=fast") == ("mode", "fast")
    with pytest.raises(Exception):
        probe.parse_lengths("128:512:0")


# ------------------------------------------------------------------ real tiny Transformer


def tiny_model(seed=0) -> Transformer:
    torch.manual_seed(seed)
    config = model_preset("tiny-2l-128", vocab_size=258, max_seq_len=512, n_layers=1)
    model = Transformer(config, attention_backend="sdpa")
    with torch.no_grad():  # larger weights: clear argmaxes, so float rounding cannot flip a greedy token
        model.lm_head.weight.mul_(30)
    return model.eval()


def write_checkpoint(run: Path, tokens: int, model: Transformer, hist: np.ndarray, spec="bytes") -> Path:
    """A trainer checkpoint in train.checkpoint's layout (full state.pt, trainer.json written last)."""
    path = run / "checkpoints" / milestone_name(tokens)
    path.mkdir(parents=True)
    torch.save({"model": model.state_dict()}, path / "state.pt")
    np.save(path / "trained_lengths.npy", hist.astype(np.int64))
    (path / "model_config.json").write_text(json.dumps(model.config.to_dict()))
    tok = get_tokenizer(spec)
    (path / "tokenizer_spec.json").write_text(json.dumps({"spec": spec, "vocab_size": tok.vocab_size,
                                                          "bos_id": tok.bos_id, "eos_id": tok.eos_id}))
    (path / "trainer.json").write_text(json.dumps({"format": FORMAT, "step": tokens // 512, "tokens_seen": tokens}))
    return path


def test_batched_and_unbatched_decoding_agree_on_a_real_model(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512, 300], minlength=513))
    settings = probe.ProbeSettings(tests_per_length=5, haystack="noise")
    loaded = probe.load_checkpoint(ckpt, settings, torch.device("cpu"))
    assert loaded.train_len == 512 and loaded.tokenizer.name == "bytes"
    tests = NiahBuilder(loaded.tokenizer, "noise").make_tests(400, 5, 0)
    cpu = torch.device("cpu")
    one = probe.generate_answers(loaded.model, loaded.tokenizer, tests, 1, cpu, max_new_tokens=16)
    many = probe.generate_answers(loaded.model, loaded.tokenizer, tests, 4, cpu, max_new_tokens=16)
    assert one == many and len(set(one)) > 1
    # The CLI on the same checkpoint writes every output file and records the answers decoded above.
    out = tmp_path / "out"
    probe.main(["--checkpoint", str(ckpt), "--lengths", "400", "--tests-per-length", "5", "--haystack", "noise",
                "--batch-size", "3", "--max-new-tokens", "16", "--out", str(out), "--quiet", "--device", "cpu"])
    records = probe.read_records(out, [400])
    assert [r["generated"] for r in records] == one
    for name in ("probe.json", "summary.csv", "effective_length.csv", "failure_by_thirds.csv", "failure_by_thirds.md",
                 "figures/niah_heatmap.png", "figures/niah_heatmap.pdf", "figures/failure_by_thirds.png"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "probe.json").read_text())
    assert meta["haystack_sha256"] == NiahBuilder(loaded.tokenizer, "noise").haystack.sha256
    assert meta["tokens_seen"] == 1024 and meta["code_version"]


def test_every_position_scheme_runs_through_the_probe(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512, 300], minlength=513))
    loaded = probe.load_checkpoint(ckpt, probe.ProbeSettings(haystack="noise"), torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 400))
    with torch.no_grad():
        rope = loaded.model(ids)
        for scheme in SCHEMES[1:]:  # every scheme changes what a 400-token input sees at L = 512
            loaded.model.set_positions(scheme)
            assert not torch.allclose(loaded.model(ids), rope, atol=1e-4), scheme
    for scheme in SCHEMES:
        out = tmp_path / scheme
        probe.main(["--checkpoint", str(ckpt), "--positions", scheme, "--lengths", "400", "--tests-per-length", "2",
                    "--haystack", "noise", "--max-new-tokens", "8", "--out", str(out), "--quiet", "--no-figures"])
        assert json.loads((out / "probe.json").read_text())["settings"]["positions"] == scheme
        assert len(probe.read_records(out, [400])) == 2


# ------------------------------------------------------------------ run level


def naive_f(hist: np.ndarray, i: int) -> int:
    """Eq. 2 by a loop over every trained segment: sum of max(n - i, 0)."""
    return sum(int(count) * max(n - i, 0) for n, count in enumerate(hist))


def make_fake_run(run: Path, train_len: int, ks: dict[int, int], seed: int = 0) -> dict[str, int]:
    """Checkpoints (tokens -> window k) with random trained-length histograms; returns name -> k."""
    rng = np.random.default_rng(seed)
    model = tiny_model()
    names = {}
    for tokens, k in ks.items():
        lengths = rng.integers(1, train_len + 1, size=tokens // train_len * 2)
        path = write_checkpoint(run, tokens, model, np.bincount(lengths, minlength=train_len + 1), spec="llama3")
        names[path.name] = k
    return names


def probe_fake_run(run: Path, out: Path, names: dict[str, int], lengths, calls: list[str], monkeypatch, tests=4,
                   figures=False):
    def fake_load(path, settings, device, attention_backend="auto"):
        calls.append(path.name)
        return fake_probe(WindowModel(TOKENIZER, names[path.name]), path.name, 512)

    monkeypatch.setattr(probe, "load_checkpoint", fake_load)
    j = job(lengths, tests)
    j.figures = figures
    return probe.probe_run(run, out, j)


def test_run_table_f_matches_naive_eq2_and_resumes(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60, 81_920: 150, 163_840: 10_000})
    lengths = [128, 256, 384, 512]
    calls: list[str] = []
    rows = probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == sorted(names)
    with open(out / "effective_length.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["tokens_seen"]) for r in table] == [40_960, 81_920, 163_840]
    assert list(table[0])[:10] == list(RUN_COLUMNS)
    assert [c for c in table[0] if c.startswith("pass_rate_")] == [f"pass_rate_{n}" for n in lengths]
    for r in table:
        hist = np.load(run / "checkpoints" / r["checkpoint"] / "trained_lengths.npy")
        eff = int(r["effective_length"])
        if r["effective_length_status"] == "none_passed":
            assert r["f_effective_length"] == ""
        else:
            assert int(r["f_effective_length"]) == naive_f(hist, eff)
        assert int(r["train_len"]) == 512 and r["positions"] == "rope"
    assert int(table[-1]["effective_length"]) == 512 and table[-1]["effective_length_status"] == "all_passed"
    effective = [int(r["effective_length"]) for r in table]
    assert 0 < effective[0] <= effective[1] < effective[2] and table[1]["effective_length_status"] == "ok"
    last_hist = np.load(run / "checkpoints" / table[-1]["checkpoint"] / "trained_lengths.npy")
    with open(out / "position_frequency.csv") as fh:
        assert [int(r["f"]) for r in csv.DictReader(fh)][:3] == [naive_f(last_hist, i) for i in range(3)]
    assert rows == probe.merge_run(run, out, job(lengths, 4), probe.Builders("noise"), probe.milestones(run))

    # Second run: nothing is loaded or decoded again, the per-test files are untouched.
    jsonl = out / sorted(names)[0] / "tests" / "L000128.jsonl"
    stamp = jsonl.stat().st_mtime_ns
    calls.clear()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == [] and jsonl.stat().st_mtime_ns == stamp
    # A lost length is redone for its checkpoint only; new settings (more tests) redo everything.
    (out / sorted(names)[1] / "tests" / "L000384.json").unlink()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == [sorted(names)[1]]
    calls.clear()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch, tests=5)
    assert calls == sorted(names)


def test_shards_then_merge(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "probe"
    names = make_fake_run(run, 512, {40_960: 150, 81_920: 300, 122_880: 400})
    calls: list[str] = []
    monkeypatch.setattr(probe, "load_checkpoint", lambda p, *a, **k: calls.append(p.name) or
                        fake_probe(WindowModel(TOKENIZER, names[p.name]), p.name))
    j = job([128, 256], 3)
    assert len(probe.probe_run(run, out, j, shard=(1, 2))) == 1 and calls == [sorted(names)[1]]
    probe.probe_run(run, out, j, shard=(0, 2))
    assert not (out / "effective_length.csv").exists()
    calls.clear()
    rows = probe.probe_run(run, out, j, merge_only=True)
    assert calls == [] and len(rows) == 3 and (out / "effective_length.csv").is_file()


# ------------------------------------------------------------------ notebook


def write_fixture_runs(root: Path, monkeypatch) -> list[Path]:
    """Two fake runs (L = 256 and 512) probed by the real pipeline with window models; returns their dirs."""
    runs = []
    for train_len, ks in ((256, {20_480: 40, 40_960: 70, 81_920: 1000}), (512, {20_480: 60, 40_960: 130, 81_920: 1000})):
        run = root / f"L{train_len}"
        names = make_fake_run(run, train_len, ks, seed=train_len)
        probe_fake_run(run, run / "probe", names, probe._default_lengths(train_len), [], monkeypatch, tests=4,
                       figures=train_len == 256)
        runs.append(run)
    return runs


def test_notebook_runs_on_fixture_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    runs = write_fixture_runs(tmp_path / "runs", monkeypatch)
    assert (runs[0] / "probe" / "figures" / "fig2a_effective_length_vs_tokens.png").is_file()
    monkeypatch.setenv("POSFREQ_RUNS", os.pathsep.join(str(r) for r in runs))
    monkeypatch.setenv("POSFREQ_FIGURES", str(tmp_path / "figures"))
    notebook = nbformat.read(REPO / "notebooks" / "effective_length_vs_position_frequency.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    for stem in ("fig2a_effective_length_vs_tokens", "fig2b_frequency_vs_effective_length", "fig3_position_frequency"):
        assert (tmp_path / "figures" / f"{stem}.png").is_file(), stem
    text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "L256" in text and "L512" in text
