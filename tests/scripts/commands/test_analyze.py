"""`posfreq analyze` (analysis/position_freq.py): shards, merge and cache; the outputs it lists and replaces; its
options; the layout's one-way imports; the CLI on a real corpus and as a module."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.corpus import SOURCES, write_slimpajama
from helpers.records import as_older_posfreq

from posfreq.scripts.commands import analyze as pf
from posfreq.train.journal import is_record

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def slimpajama(tmp_path):
    return write_slimpajama(tmp_path)


def analyze_args(root: Path) -> list[str]:
    """`posfreq analyze` over the SlimPajama-layout fixture, one worker, quiet."""
    return [
        *"--corpus slimpajama --tokenizer bytes --workers 1 --quiet".split(),
        "--data-dir",
        str(root),
    ]


def slimpajama_args(root: Path) -> list[str]:
    """The same at L = 16 and 32."""
    return [*analyze_args(root), "--train-len", "16", "32"]


def test_cli_shards_merge_and_cache(slimpajama, tmp_path, monkeypatch):
    root, records = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    common = slimpajama_args(root)
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
    """Every file under `out`, as a path relative to it, but the owner record and journal (train/journal.py)."""
    return {
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and not is_record(p.name)
    }


def summary_files(out: Path) -> list[str]:
    """The `files` list of out/summary.json."""
    return json.loads((out / "summary.json").read_text())["files"]


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_rerun_with_other_lengths_leaves_only_its_own_outputs(slimpajama, tmp_path, monkeypatch):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    common = [
        *analyze_args(root),
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
    with pytest.raises(SystemExit, match=r"did not write \(notes.txt"):  # refused before any work
        pf.main(common + ["--train-len", "16"])
    assert (out / "notes.txt").read_text() == "not the job's: never deleted, never listed"
    (out / "notes.txt").unlink()

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
    assert listing(out) == expected
    assert list(json.loads((out / "summary.json").read_text())["all"]["by_train_len"]) == ["16"]
    assert {key.split("/")[0] for key in np.load(out / "position_frequency.npz").files} == {"L16"}

    assert pf.main(common + ["--train-len", "16", "--no-figures"]) == 0
    assert listing(out) == set(summary_files(out)) and not (out / "figures").exists()
    assert (
        pf.main(common + ["--shard", "0/2"]) == 0
    )  # a partial histogram replaces the full outputs too
    assert listing(out) == {"histogram.npz", "summary.json"}
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
        match="error: --out .* holds files `posfreq analyze` did not write",
    ):
        pf.main(
            [
                *analyze_args(root),
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


def test_a_users_folder_is_refused_before_counting_and_an_older_output_is_rerun(
    slimpajama, tmp_path, monkeypatch
):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    args = [*analyze_args(root), "--no-figures", "--out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "lengths.csv").write_text("my own table")
    counted = []
    monkeypatch.setattr(pf, "_count", lambda *a: counted.append(a))
    with pytest.raises(SystemExit, match=r"did not write \(lengths.csv\)"):
        pf.main([*args, str(mine), "--train-len", "16"])
    assert counted == [] and listing(mine) == {"lengths.csv"}
    assert (mine / "lengths.csv").read_text() == "my own table"
    monkeypatch.chdir(
        tmp_path
    )  # the default --out, runs/position_freq/<corpus name>, is checked first too
    default = tmp_path / "runs/position_freq/slimpajama"  # as docs/corpus_analysis.md says
    default.mkdir(parents=True)
    (default / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"did not write \(notes.txt\)"):
        pf.main([*analyze_args(root), "--no-figures", "--train-len", "16"])
    assert counted == []

    monkeypatch.undo()
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    older = tmp_path / "older"  # as a posfreq before owner records wrote it
    assert pf.main([*args, str(older), "--train-len", "32"]) == 0
    as_older_posfreq(older)
    assert pf.main([*args, str(older), "--train-len", "16"]) == 0
    assert "position_frequency_L32.csv" not in listing(older)
    assert listing(older) == set(summary_files(older))

    sharded = tmp_path / "sharded"  # slurm/position_freq.sh's layout, as an older posfreq wrote it
    for i in range(2):
        assert pf.main([*args, str(sharded / f"shard_{i}"), "--shard", f"{i}/2"]) == 0
        as_older_posfreq(sharded / f"shard_{i}")
    parts = [str(sharded / f"shard_{i}") for i in range(2)]
    assert (
        pf.main(["--merge", *parts, "--no-figures", "--train-len", "16", "--out", str(sharded)])
        == 0
    )
    assert {"summary.json", "shard_0/histogram.npz", "shard_1/histogram.npz"} <= listing(sharded)
    as_older_posfreq(sharded)  # an older merge, whose counts are then resubmitted by this version
    assert pf.main([*args, str(sharded / "shard_0"), "--shard", "0/2"]) == 0
    assert (
        pf.main(["--merge", *parts, "--no-figures", "--train-len", "16", "--out", str(sharded)])
        == 0
    )


def test_source_lists_comma_yaml_and_config_file_agree(slimpajama, tmp_path, monkeypatch):
    root, records = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    common = [
        *analyze_args(root),
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
    "module", ["posfreq.scripts.commands.analyze", "posfreq.scripts.commands.prepare"]
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


@pytest.mark.slow
def test_layout_imports_flow_one_way():
    """frequency needs neither matplotlib nor torch; plots needs no other analysis module; train never imports analysis."""
    code = (
        "import sys; import posfreq.analysis.corpus.frequency; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch')], 'frequency'; "
        "import posfreq.analysis.plots.frequency, posfreq.train.data.corpus_cli, posfreq.train.data.corpora; "
        "analysis = {m for m in sys.modules if m.startswith('posfreq.analysis.')}; "
        "assert analysis == {'posfreq.analysis.corpus', 'posfreq.analysis.corpus.frequency', "
        "'posfreq.analysis.plots', 'posfreq.analysis.plots.frequency'}, analysis; "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for path in (REPO / "train").rglob("*.py"):
        assert not re.search(r"^\s*(from|import) posfreq\.analysis", path.read_text(), re.M), (
            path.name
        )


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
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


@pytest.mark.slow
def test_module_entry_point_and_missing_slimpajama(tmp_path):
    env = {"SLIMPAJAMA_DIR": str(tmp_path / "none"), "POSFREQ_CACHE": str(tmp_path), "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "posfreq.scripts.commands.analyze", "--quiet"],
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


@pytest.mark.slow
def test_cli_packing_options(slimpajama, tmp_path, monkeypatch, capsys):
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    common = slimpajama_args(root)
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


@pytest.mark.parametrize("budget", ["-1", "0", "1e400", "1e20"])
def test_a_token_budget_out_of_range_is_refused_before_counting(budget, tmp_path, capsys):
    """`--total-tokens -1` wrote a negative f and 1e400 wrote inf and NaN into summary.json."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as refused:
        pf.main(["--corpus", "pg-essays", "--total-tokens", budget, "--out", str(out)])
    assert refused.value.code == 2
    assert "--total-tokens must be a finite token count from 1 to 2^53" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_a_replaced_tokenizer_file_is_counted_anew_not_read_from_the_cache(
    slimpajama, tmp_path, monkeypatch
):
    """The cache was keyed by the tokenizer's spec (hf:T): after T/tokenizer.json was replaced, a rerun read
    the old counts back. The key holds the tokenizer's content now."""
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer, write_llama3_tokenizer

    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    tok = tmp_path / "T"
    write_bytes_tokenizer(tok)
    args = [
        *"--corpus slimpajama --workers 1 --quiet --train-len 16 --no-figures".split(),
        *("--data-dir", str(root), "--tokenizer", f"hf:{tok}"),
    ]

    def tokens(out: str, *extra: str) -> int:
        assert pf.main([*args, "--out", str(tmp_path / out), *extra]) == 0
        return json.loads((tmp_path / out / "summary.json").read_text())["all"]["tokens"]

    as_bytes = tokens("bytes")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).unlink()
    write_llama3_tokenizer(tok)  # another tokenizer at the same path
    rerun = tokens("llama3")
    assert rerun == tokens("llama3-no-cache", "--no-cache") and rerun < as_bytes


def test_a_summary_listing_a_users_file_never_deletes_it(slimpajama, tmp_path, monkeypatch):
    """A summary.json that lists thesis.tex made a rerun delete it: only what the folder's journal records as
    written by posfreq is removed, and a folder holding an unrecorded file is refused untouched."""
    root, _ = slimpajama
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "pf"
    args = [*analyze_args(root), "--no-figures", "--out", str(out), "--train-len", "16"]
    assert pf.main(args) == 0
    thesis = out / "thesis.tex"
    thesis.write_text("two years of work")
    summary = json.loads((out / "summary.json").read_text())
    summary["files"].append("thesis.tex")
    (out / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match=r"did not write \(thesis.tex"):
        pf.main(args)
    assert thesis.read_text() == "two years of work"
    (
        out / ".posfreq-files"
    ).write_text(  # even recorded by hand in summary and journal alike: a link is not
        (out / ".posfreq-files").read_text() + "thesis.tex\n"
    )
    thesis.unlink()
    outside = tmp_path / "thesis.tex"
    outside.write_text("two years of work")
    thesis.symlink_to(outside)  # followed, it would delete the user's file
    with pytest.raises(SystemExit, match="outside"):
        pf.main(args)
    assert outside.read_text() == "two years of work" and thesis.is_symlink()


def test_a_rewrite_of_the_same_size_with_its_mtime_restored_is_counted_anew(tmp_path, monkeypatch):
    """The review's route: a corpus rewritten with the same size, its mtime set back (touch -r), read its old
    counts from the cache: one document where --no-cache counts two. The key holds each file's change time, which
    any write moves and no user command sets back."""
    import os

    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "two_docs.jsonl"
    corpus.write_text(json.dumps({"text": "a" * 41}) + "\n")  # one document, 52 bytes
    stamp = corpus.stat()
    args = [*"--workers 1 --quiet --train-len 16 --no-figures --tokenizer bytes".split()]

    def documents(out: str, *extra: str) -> int:
        assert pf.main(["--corpus", str(corpus), *args, "--out", str(tmp_path / out), *extra]) == 0
        return json.loads((tmp_path / out / "summary.json").read_text())["all"]["documents"]

    assert documents("first") == 1
    corpus.write_text(json.dumps({"text": "b" * 15}) + "\n" + json.dumps({"text": "c" * 13}) + "\n")
    assert corpus.stat().st_size == stamp.st_size
    os.utime(corpus, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # touch -r
    assert corpus.stat().st_mtime_ns == stamp.st_mtime_ns
    assert documents("rewritten") == documents("recounted", "--no-cache") == 2


def test_a_train_len_beyond_what_posfreq_plans_is_refused_before_any_array(tmp_path, capsys):
    """--train-len 300000000 on a two-document corpus took 800 MB and hung: it is a usage error now, in well under
    a second, naming the limit."""
    import time

    corpus = tmp_path / "two_docs.jsonl"
    corpus.write_text('{"text": "ab"}\n{"text": "cd"}\n')
    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        pf.main(["--corpus", str(corpus), "--train-len", "300000000", "--out", str(tmp_path / "o")])
    assert stop.value.code == 2 and time.perf_counter() - start < 1
    assert (
        "--train-len 300,000,000 is beyond the longest training length posfreq plans"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()
