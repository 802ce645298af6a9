"""Eq. 2 against a naive reference and analytic cases; the histogram job, cache, shards; the CLI and its outputs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posfreq.analysis import frequency as fq
from posfreq.analysis import histogram as hg
from posfreq.analysis import position_freq as pf
from posfreq.train.corpora import resolve_corpus, write_jsonl
from posfreq.train.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]


def naive_frequency(length_hist, train_len):
    """Eq. 2 by definition: cut every document into pieces of <= L, then a double loop."""
    f = [0] * train_len
    for length, count in enumerate(length_hist):
        pieces = [train_len] * (length // train_len) + (
            [length % train_len] if length % train_len else []
        )
        for piece in pieces:
            for i in range(train_len):
                f[i] += count * max(piece - i, 0)
    return np.array(f, dtype=np.int64)


@pytest.mark.parametrize("seed", range(5))
def test_fast_path_matches_naive_double_loop(seed):
    rng = np.random.default_rng(seed)
    train_len = int(rng.integers(2, 40))
    hist = rng.integers(0, 5, size=int(rng.integers(1, 4 * train_len)))
    hist[min(train_len, hist.size - 1)] += 3  # documents of exactly L (or the longest there is)
    f = fq.position_frequency(hist, train_len)
    assert f.dtype == np.int64 and f.shape == (train_len,)
    np.testing.assert_array_equal(f, naive_frequency(hist, train_len))


def test_one_document_of_length_L():
    L = 64
    np.testing.assert_array_equal(
        fq.position_frequency(fq.concatenated_histogram(1, L), L), L - np.arange(L)
    )


def test_concatenated_rows_are_linear():
    L, rows = 128, 1000
    f = fq.position_frequency(fq.concatenated_histogram(rows, L), L)
    np.testing.assert_array_equal(f, rows * (L - np.arange(L)))


def test_uniform_lengths_are_quadratic():
    L = 100
    f = fq.position_frequency(fq.uniform_length_histogram(L, docs_per_length=3), L)
    k = L - np.arange(L)
    np.testing.assert_array_equal(f, 3 * k * (k + 1) // 2)


def test_truncation_before_eq2():
    L = 10
    hist = np.zeros(2 * L + 4, dtype=np.int64)
    hist[2 * L + 3] = 1  # one document of 23 tokens -> pieces 10, 10, 3
    np.testing.assert_array_equal(fq.piece_histogram(hist, L)[[3, L]], [1, 2])
    expected = 2 * (L - np.arange(L)) + np.maximum(3 - np.arange(L), 0)
    np.testing.assert_array_equal(fq.position_frequency(hist, L), expected)


def test_trained_segment_histogram_needs_no_truncation():
    L = 16
    segments = np.bincount([16, 16, 5, 1, 9, 16], minlength=L + 1)  # as a checkpoint stores it
    expected = sum(np.maximum(n - np.arange(L), 0) for n in [16, 16, 5, 1, 9, 16])
    np.testing.assert_array_equal(fq.position_frequency(segments, L), expected)


def test_exact_in_int64_at_trillion_scale():
    L = 2048
    f = fq.position_frequency(fq.concatenated_histogram(10**12 // L, L), L)
    assert int(f[0]) == (10**12 // L) * L and f.dtype == np.int64


def test_scale_to_budget_and_bad_inputs():
    f = fq.position_frequency(np.bincount([4, 8], minlength=9), 8)
    scaled = fq.scale_to_budget(f, 1200)
    assert scaled[0] == pytest.approx(1200) and scaled[1] == pytest.approx(1200 * f[1] / f[0])
    with pytest.raises(ValueError, match="integer"):
        fq.position_frequency(np.array([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match="negative"):
        fq.position_frequency(np.array([0, -1]), 4)
    with pytest.raises(ValueError, match="1-D"):
        fq.position_frequency(np.zeros((2, 2), dtype=int), 4)


def test_frequency_stats_shares():
    L = 8
    hist = fq.concatenated_histogram(1, L)
    stats = fq.frequency_stats(hist, L, budget_tokens=80)
    f = L - np.arange(L)  # 8..1, sum 36; i <= 4: 8+7+6+5+4 = 30; i >= 6: 2+1 = 3
    assert stats["share_pieces_at_L"] == 1.0
    assert stats["share_positions_le_half_L"] == pytest.approx(30 / f.sum())
    assert stats["share_positions_ge_three_quarter_L"] == pytest.approx(3 / f.sum())
    assert fq.length_stats(np.bincount([2, 2, 3, 10]))["median_length"] == 2


def test_histogram_npz_round_trip(tmp_path):
    h = hg.LengthHistogram()
    h.add("a", np.array([3, 3, 70000]))
    h.add("b", np.array([5]))
    hg.save_histogram(tmp_path / "h.npz", h, {"x": 1})
    back, meta = hg.load_histogram(tmp_path / "h.npz")
    assert meta == {"x": 1} and back.sources == ["a", "b"]
    np.testing.assert_array_equal(back.counts(), h.counts())


# --------------------------------------------------------------------------- corpus histograms

SOURCES = ("RedPajamaC4", "RedPajamaGithub", "RedPajamaBook")


@pytest.fixture
def slimpajama(tmp_path):
    """A small SlimPajama-layout corpus (3 chunk dirs, .jsonl.zst, mixed sources) and its records."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "\n", "1234", "::", "x"]
    records = []
    for chunk in (1, 2, 10):
        for n in range(2):
            recs = [
                {
                    "text": " ".join(rng.choice(words, size=int(rng.integers(0, 300)))),
                    "meta": {"redpajama_set_name": SOURCES[int(rng.integers(0, 3))]},
                }
                for _ in range(15)
            ]
            write_jsonl(
                tmp_path / "sp" / "train" / f"chunk{chunk}" / f"example_train_{n}.jsonl.zst", recs
            )
            records.extend(recs)
    return tmp_path / "sp", records


def one_by_one(records, tokenizer, keep=lambda source: True):
    """Reference: tokenize each document alone, length = tokens + EOS, counted per source."""
    out = {}
    for r in records:
        source = r["meta"]["redpajama_set_name"]
        if keep(source):
            out.setdefault(source, []).append(len(tokenizer.encode(r["text"])) + 1)
    return {s: np.bincount(v) for s, v in out.items()}


def assert_histograms_equal(histogram, expected):
    assert histogram.sources == sorted(expected)
    for source, hist in expected.items():
        np.testing.assert_array_equal(histogram.counts(source), np.trim_zeros(hist, "b"))


@pytest.mark.parametrize("tokenizer", ["bytes", "llama3"])
def test_corpus_histogram_equals_tokenizing_one_by_one(slimpajama, tokenizer):
    root, records = slimpajama
    corpus = resolve_corpus("slimpajama", data_dir=root)
    settings = hg.CountSettings(tokenizer=tokenizer, default_source=corpus.default_source)
    histogram, stats = hg.count_lengths(corpus.files, settings, workers=1, progress=False)
    assert stats.documents == len(records)
    assert_histograms_equal(histogram, one_by_one(records, get_tokenizer(tokenizer)))


def test_source_filter_and_worker_shard_independence(slimpajama):
    root, records = slimpajama
    corpus = resolve_corpus("slimpajama", data_dir=root, sources=["-github"])
    settings = hg.CountSettings(tokenizer="bytes", sources=corpus.sources)
    serial, _ = hg.count_lengths(corpus.files, settings, workers=1, progress=False)
    expected = one_by_one(records, get_tokenizer("bytes"), keep=lambda s: s != "RedPajamaGithub")
    assert_histograms_equal(serial, expected)
    parallel, _ = hg.count_lengths(corpus.files, settings, workers=2, progress=False)
    merged = hg.LengthHistogram()
    for i in range(4):
        part, _ = hg.count_lengths(corpus.shard(i, 4).files, settings, workers=1, progress=False)
        merged.merge(part)
    for other in (parallel, merged):
        assert other.sources == serial.sources
        for s in serial.sources:
            np.testing.assert_array_equal(other.counts(s), serial.counts(s))


def test_cli_shards_merge_and_cache(slimpajama, tmp_path, monkeypatch):
    root, records = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    common = [
        "--corpus",
        "slimpajama",
        "--data-dir",
        str(root),
        "--tokenizer",
        "bytes",
        "--workers",
        "1",
        "--quiet",
        "--train-len",
        "16",
        "32",
    ]
    for i in range(3):
        assert pf.main(common + ["--shard", f"{i}/3", "--out", str(tmp_path / f"shard_{i}")]) == 0
    with pytest.raises(SystemExit, match="shards 0..n-1"):
        pf.main(
            [
                "--merge",
                str(tmp_path / "shard_0"),
                str(tmp_path / "shard_1"),
                "--out",
                str(tmp_path / "x"),
            ]
        )
    pf.main(
        [
            "--merge",
            *(str(tmp_path / f"shard_{i}") for i in range(3)),
            "--out",
            str(tmp_path / "merged"),
            "--train-len",
            "16",
            "32",
            "--no-figures",
        ]
    )
    pf.main(common + ["--out", str(tmp_path / "whole"), "--no-figures"])
    assert list(
        (tmp_path / "cache" / "position_freq").glob("*.npz")
    )  # cached: a re-run reads it back
    merged = json.loads((tmp_path / "merged" / "summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert merged["all"] == whole["all"] and merged["by_source"] == whole["by_source"]
    assert whole["all"]["documents"] == len(records)
    assert set(whole["by_source"]) == set(SOURCES)


def test_empty_corpus_is_an_error(slimpajama, tmp_path, monkeypatch):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match="no documents"):
        pf.main(
            [
                "--corpus",
                "slimpajama",
                "--data-dir",
                str(root),
                "--sources",
                "wikipedia",
                "--tokenizer",
                "bytes",
                "--workers",
                "1",
                "--quiet",
                "--out",
                str(tmp_path / "o"),
            ]
        )
    assert not (tmp_path / "o").exists()


def listing(out: Path) -> set[str]:
    """Every file under `out`, as a path relative to it."""
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


def summary_files(out: Path) -> list[str]:
    """The `files` list of out/summary.json."""
    return json.loads((out / "summary.json").read_text())["files"]


def test_rerun_with_other_lengths_leaves_only_its_own_outputs(slimpajama, tmp_path, monkeypatch):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    common = [
        "--corpus",
        "slimpajama",
        "--data-dir",
        str(root),
        "--tokenizer",
        "bytes",
        "--workers",
        "1",
        "--quiet",
        "--out",
        str(out),
    ]
    assert pf.main(common + ["--train-len", "32", "64"]) == 0
    assert listing(out) == set(summary_files(out))
    assert {
        "position_frequency_L64.csv",
        "figures/fig1a_L64.pdf",
        "figures/fig3_L32_vs_L64.png",
    } <= listing(out)
    (out / "notes.txt").write_text("not the job's: never deleted, never listed")

    assert pf.main(common + ["--train-len", "16"]) == 0
    expected = {
        "summary.json",
        "histogram.npz",
        "lengths.csv",
        "position_frequency.npz",
        "position_frequency_L16.csv",
    }
    expected |= {
        f"figures/fig{name}_L16.{ext}"
        for name in ("1a", "1b", "1c", "_packing")
        for ext in ("png", "pdf")
    }
    assert summary_files(out) == sorted(expected)
    assert listing(out) == expected | {"notes.txt"}
    assert list(json.loads((out / "summary.json").read_text())["all"]["by_train_len"]) == ["16"]
    assert {key.split("/")[0] for key in np.load(out / "position_frequency.npz").files} == {"L16"}

    assert pf.main(common + ["--train-len", "16", "--no-figures"]) == 0
    assert (
        listing(out) == set(summary_files(out)) | {"notes.txt"} and not (out / "figures").exists()
    )
    assert (
        pf.main(common + ["--shard", "0/2"]) == 0
    )  # a partial histogram replaces the full outputs too
    assert listing(out) == {"histogram.npz", "summary.json", "notes.txt"}
    assert summary_files(out) == ["histogram.npz", "summary.json"]


@pytest.mark.parametrize(
    "listed", [None, ["../victim.txt"], ["sub"]], ids=["no-files-list", "outside-out", "folder"]
)
def test_outputs_it_did_not_list_are_never_deleted(slimpajama, tmp_path, monkeypatch, listed):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (tmp_path / "victim.txt").write_text("keep")
    (out / "lengths.csv").write_text("an older run's")
    (out / "summary.json").write_text(
        json.dumps({"all": {}} if listed is None else {"files": listed})
    )
    with pytest.raises(
        SystemExit,
        match="error: .*summary.json (does not list the files|lists files outside|lists folders)",
    ):
        pf.main(
            [
                "--corpus",
                "slimpajama",
                "--data-dir",
                str(root),
                "--tokenizer",
                "bytes",
                "--workers",
                "1",
                "--quiet",
                "--no-figures",
                "--train-len",
                "16",
                "--out",
                str(out),
            ]
        )
    assert (
        listing(out) == {"lengths.csv", "summary.json"}
        and (tmp_path / "victim.txt").read_text() == "keep"
    )


def test_source_lists_comma_yaml_and_config_file_agree(slimpajama, tmp_path, monkeypatch):
    root, records = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    common = [
        "--corpus",
        "slimpajama",
        "--data-dir",
        str(root),
        "--tokenizer",
        "bytes",
        "--workers",
        "1",
        "--quiet",
        "--no-figures",
        "--no-cache",
        "--train-len",
        "16",
    ]
    config = tmp_path / "analyze.yaml"
    config.write_text("sources: [c4, RedPajamaBook]\nexclude_sources: [book]\n")
    runs = {
        "comma": ["--sources", "c4,book", "--exclude-sources", "book"],
        "yaml": ["--sources", "[C4, book]", "--exclude-sources", "[book]"],
        "config": ["--config", str(config)],
    }
    for name, flags in runs.items():
        assert pf.main(common + flags + ["--out", str(tmp_path / name)]) == 0
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["all"]["documents"] == sum(
            r["meta"]["redpajama_set_name"] == "RedPajamaC4" for r in records
        )
        assert list(summary["by_source"]) == ["RedPajamaC4"]
    with pytest.raises(SystemExit, match="--exclude-sources github"):
        pf.main(common + ["--sources", "c4,-github", "--out", str(tmp_path / "refused")])


@pytest.mark.parametrize(
    "module", ["posfreq.analysis.position_freq", "posfreq.scripts.prepare_data"]
)
def test_every_option_has_help_and_a_shown_default(module):
    import importlib

    parser = importlib.import_module(module).build_parser()
    section = parser.format_help().split("\noptions:\n")[1]
    blocks = {
        block.split()[0].rstrip(","): " ".join(block.split())
        for block in re.split(r"\n(?=  -)", section)
    }
    options = [
        a
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "config", "print_config")
    ]
    for action in options:
        shown = blocks[action.option_strings[0]]
        assert action.help and action.help in shown, shown
        assert "default:" in shown or (action.required and "required" in shown), shown
    flags = {o for a in options for o in a.option_strings}
    assert {
        "--corpus",
        "--data-dir",
        "--sources",
        "--exclude-sources",
        "--workers",
        "--tokenizer",
        "--out",
        "--shard",
        "--on-error",
    } <= flags


def test_layout_imports_flow_one_way():
    """frequency needs neither matplotlib nor torch; plots needs no other analysis module; train never imports analysis."""
    code = (
        "import sys; import posfreq.analysis.frequency; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch')], 'frequency'; "
        "import posfreq.analysis.plots, posfreq.train.corpus_cli, posfreq.train.corpora; "
        "analysis = {m for m in sys.modules if m.startswith('posfreq.analysis.')}; "
        "assert analysis == {'posfreq.analysis.frequency', 'posfreq.analysis.plots'}, analysis; "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for path in (REPO / "train").glob("*.py"):
        assert not re.search(r"^\s*(from|import) posfreq\.analysis", path.read_text(), re.M), (
            path.name
        )


def test_cli_on_pg_essays_writes_all_outputs(tmp_path):
    out = tmp_path / "pg"
    cmd = [
        sys.executable,
        "analysis/position_freq.py",
        "--corpus",
        "pg-essays",
        "--out",
        str(out),
        "--workers",
        "2",
        "--no-cache",
        "--quiet",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "i<=L/2" in result.stdout
    for name in [
        "summary.json",
        "histogram.npz",
        "lengths.csv",
        "position_frequency.npz",
        "position_frequency_L2048.csv",
        "position_frequency_L4096.csv",
    ]:
        assert (out / name).is_file(), name
    for fig in ["fig1a_L2048", "fig1b_L2048", "fig1c_L4096", "fig3_L2048_vs_L4096"]:
        assert (out / "figures" / f"{fig}.png").is_file() and (
            out / "figures" / f"{fig}.pdf"
        ).is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["all"]["documents"] == 49
    assert listing(out) == set(summary["files"])
    f = np.load(out / "position_frequency.npz")["L2048/f"]
    assert f[0] == summary["all"]["tokens"]  # no piece is lost: f(0) counts every token


def test_module_entry_point_and_missing_slimpajama(tmp_path):
    env = {"SLIMPAJAMA_DIR": str(tmp_path / "none"), "POSFREQ_CACHE": str(tmp_path), "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "posfreq.analysis.position_freq", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    assert (
        "SlimPajama (train split) not found" in result.stderr
        and "--corpus pg-essays" in result.stderr
    )


# ------------------------------------------------------------------------- trained f per packing


def naive_pieces(length_hist, train_len):
    """Every piece length, by cutting each document every L tokens in a loop."""
    pieces = []
    for length, count in enumerate(length_hist):
        for _ in range(int(count)):
            pieces += [train_len] * (length // train_len) + (
                [length % train_len] if length % train_len else []
            )
    return pieces


def naive_best_fit_rows(sizes, capacity):
    """Rows best-fit decreasing needs: each piece, longest first, into the fullest open row that holds it."""
    free = []
    for size in sorted(sizes, reverse=True):
        fits = [k for k, space in enumerate(free) if space >= size]
        if fits:
            k = min(fits, key=lambda j: free[j])
            free[k] -= size
        else:
            free.append(capacity - size)
    return len(free)


def concat_segments(doc_len, docs, train_len):
    """Brute force for a corpus of `docs` documents of one length (any order is the same order): lay the epoch's
    documents end to end (and the next epoch's after them), cut rows of L from its start until a row starts past
    the epoch, and cut each row's tokens wherever a document, a piece (every L tokens of a document) or a row
    ends; returns the segment lengths."""
    rows = -(-doc_len * docs // train_len)
    end = rows * train_len
    cuts = set(range(0, end + 1, train_len))
    for start in range(0, end, doc_len):
        cuts |= set(range(start, min(start + doc_len, end), train_len)) | {
            min(start + doc_len, end)
        }
    cuts = sorted(cuts)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def write(histogram, tmp_path, train_lens, **settings):
    """write_outputs without figures into tmp_path/out; returns (summary, npz arrays)."""
    out = tmp_path / "out"
    summary = pf.write_outputs(
        out,
        histogram,
        {"corpus": "test"},
        train_lens,
        1e12,
        pf.PackingSettings(**settings),
        figures=False,
    )
    with np.load(out / "position_frequency.npz") as arrays:
        return summary, dict(arrays)


def test_best_fit_and_padded_train_exactly_eq2_over_the_pieces(tmp_path):
    rng = np.random.default_rng(7)
    histogram = hg.LengthHistogram()
    histogram.add("a", rng.integers(1, 90, size=60))
    histogram.add("b", rng.integers(1, 40, size=40))
    train_lens = [16, 24, 64]
    summary, arrays = write(
        histogram, tmp_path, train_lens, seed=3, shuffle_block=1000, global_batch_tokens=1000
    )
    hist = histogram.counts()
    for L in train_lens:
        expected = naive_frequency(hist, L)
        pieces = naive_pieces(hist, L)
        tokens = sum(pieces)
        np.testing.assert_array_equal(arrays[f"L{L}/f_trained_best_fit"], expected)
        np.testing.assert_array_equal(arrays[f"L{L}/f_trained_padded"], expected)
        packing = summary["all"]["by_train_len"][str(L)]["packing"]
        assert packing["padded"]["rows_per_epoch"] == len(pieces)
        assert packing["padded"]["padding_share"] == pytest.approx(1 - tokens / (len(pieces) * L))
        assert packing["padded"]["tokens_lost_per_step"] == pytest.approx(
            1000 * (1 - tokens / (len(pieces) * L))
        )
        rows = naive_best_fit_rows(pieces, L)  # one shuffle block holds the whole corpus
        assert packing["best_fit"]["rows_per_epoch"] == rows
        assert packing["best_fit"]["padding_share"] == pytest.approx(1 - tokens / (rows * L))
        for strategy in ("best_fit", "padded"):
            stats = packing[strategy]
            assert stats["position_occurrences"] == expected.sum()
            assert stats["share_positions_le_half_L"] == pytest.approx(
                expected[: L // 2 + 1].sum() / expected.sum()
            )
            assert stats["share_positions_ge_three_quarter_L"] == pytest.approx(
                expected[3 * L // 4 :].sum() / expected.sum()
            )
            assert stats["share_segments_at_L"] == pytest.approx(pieces.count(L) / len(pieces))


@pytest.mark.parametrize(
    "doc_len, docs, train_len", [(37, 11, 16), (16, 5, 16), (5, 40, 16), (100, 3, 64)]
)
@pytest.mark.parametrize("copies", [1, 2])
def test_concat_prediction_equals_a_brute_force_stream(tmp_path, doc_len, docs, train_len, copies):
    histogram = hg.LengthHistogram()
    histogram.add("only", np.full(docs, doc_len))
    upsample = {"0-": float(copies)} if copies > 1 else {}
    summary, arrays = write(histogram, tmp_path, [train_len], seed=1, length_upsample=upsample)
    segments = concat_segments(doc_len, copies * docs, train_len)
    expected = naive_frequency(np.bincount(segments), train_len)
    np.testing.assert_array_equal(arrays[f"L{train_len}/f_trained_concat"], expected)
    stats = summary["all"]["by_train_len"][str(train_len)]["packing"]["concat"]
    assert stats["rows_per_epoch"] == -(-copies * docs * doc_len // train_len)
    assert stats["padding_share"] == 0 and stats["tokens_lost_per_step"] == 0
    assert stats["share_segments_at_L"] == pytest.approx(segments.count(train_len) / len(segments))
    np.testing.assert_array_equal(
        arrays[f"L{train_len}/f"], naive_frequency(histogram.counts(), train_len)
    )


def test_length_upsample_weights_the_trained_f_not_the_corpus_f(tmp_path):
    histogram = hg.LengthHistogram()
    histogram.add("arxiv", np.array([50, 70, 70, 9]))
    histogram.add("c4", np.array([3, 12, 30, 30]))
    _, arrays = write(histogram, tmp_path, [32], length_upsample={"arxiv:0-": 3.0, "0-20": 2.0})
    weighted = 3 * histogram.counts("arxiv")
    c4 = histogram.counts("c4")
    weighted[: c4.size] += np.where(np.arange(c4.size) < 20, 2, 1) * c4
    np.testing.assert_array_equal(arrays["L32/f_trained_best_fit"], naive_frequency(weighted, 32))
    np.testing.assert_array_equal(arrays["L32/f"], naive_frequency(histogram.counts(), 32))


def test_cli_packing_options(slimpajama, tmp_path, monkeypatch, capsys):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    common = [
        "--corpus",
        "slimpajama",
        "--data-dir",
        str(root),
        "--tokenizer",
        "bytes",
        "--workers",
        "1",
        "--quiet",
        "--train-len",
        "16",
        "32",
    ]
    out = tmp_path / "out"
    assert (
        pf.main(
            common
            + [
                "--out",
                str(out),
                "--packing",
                "padded",
                "concat",
                "--seed",
                "4",
                "--length-upsample",
                "{0-100: 0.5}",
                "--global-batch-tokens",
                "1000",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["packing_settings"] == {
        "strategies": ["padded", "concat"],
        "length_upsample": {"0-100": 0.5},
        "seed": 4,
        "shuffle_block": 1 << 20,
        "global_batch_tokens": 1000,
    }
    assert list(summary["all"]["by_train_len"]["32"]["packing"]) == ["padded", "concat"]
    header = (out / "position_frequency_L16.csv").read_text().splitlines()[0].split(",")
    assert {"f", "f_trained_padded", "f_trained_concat"} <= set(
        header
    ) and "f_trained_best_fit" not in header
    assert {"figures/fig_packing_L32.png", "figures/fig3_L16_vs_L32.pdf"} <= set(summary["files"])
    assert listing(out) == set(summary["files"])
    printed = capsys.readouterr().out
    assert "per packing (seed 4" in printed and re.search(r"\n  padded +[\d,]+ +16 ", printed)
    with pytest.raises(SystemExit, match="sources this corpus does not have: \\['wiki'\\]"):
        pf.main(
            common
            + ["--out", str(tmp_path / "x"), "--length-upsample", "{wiki:0-: 2}", "--no-figures"]
        )
    with pytest.raises(SystemExit):
        pf.main(common + ["--out", str(tmp_path / "x"), "--length-upsample", "{0-: 0}"])
    assert "every document length has weight 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_first_split_and_log_spaced_buckets():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.uniform(1, 2, size=30)
        b = a * np.where(rng.random(30) < 0.1, 1.2, 1.0)
        apart = [i for i in range(30) if abs(a[i] - b[i]) > 0.05 * max(a[i], b[i])]
        assert fq.first_split(a, b) == (apart[0] if apart else None)
    for L in (2, 16, 100, 2048):
        buckets = fq.length_buckets(L)
        assert [n for lo, hi in buckets for n in range(lo, hi)] == list(
            range(1, L + 1)
        )  # each length once
        assert all(hi == 2 * lo for lo, hi in buckets[:-2]) and buckets[-1] == (L, L + 1)


def test_fig3_note_says_why_the_curves_part():
    L1, L2 = 256, 512
    i1, i2 = np.arange(L1), np.arange(L2)
    long_docs = {
        L1: 1e12 * (1 - i1 / L1),
        L2: 1e12 * (1 - i2 / L2),
    }  # Fig. 1c: every token in full rows
    stats = {L1: {"share_tokens_in_documents_longer_than_L": 0.9}}
    # (1 - i/256) / (1 - i/512) < 0.95 first at i = 25
    assert min(i for i in range(L1) if (1 - i / L1) / (1 - i / L2) < 0.95) == 25
    note = pf.fig3_note(long_docs, stats)
    assert (
        "apart from i = 25" in note and "90% of the tokens are in documents longer than 256" in note
    )
    assert "i = 0" not in note and "row boundary" not in note
    assert "row boundary" in pf.fig3_note(long_docs, stats, concat=True)
    padded = {L1: 0.6 * long_docs[L1], L2: 0.3 * long_docs[L2]}
    assert pf.fig3_note(padded, stats, padding={L1: 0.4, L2: 0.7}).startswith(
        "Apart from i = 0: padding fills 40.0% of the L = 256 rows and 70.0% of the L = 512 rows"
    )
    short_docs = {L: np.full(L, 1e12) for L in (L1, L2)}
    assert pf.fig3_note(short_docs, stats) == "f/f(0) within 5% at every i < 256."
