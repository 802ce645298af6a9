"""train/data/tokens/rerun.py: what a rerun of `posfreq prepare` redoes (inputs compared by content, tokenizers by
their files, finished inputs hashed in parallel) and what it refuses (another input's shard under the same name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posfreq.train.data.tokenizer import get_tokenizer
from posfreq.train.data.tokens.rerun import pending_files
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.outdir import OutputDirError


@pytest.mark.slow
def test_a_rerun_compares_inputs_and_tokenizers_by_content(tmp_path: Path) -> None:
    """prepare's resume compared an input's size only (a same-size edit kept the old shard) and the tokenizer
    by name only (a replaced hf:T/tokenizer.json kept tokens of the old one)."""
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer, write_llama3_tokenizer
    from posfreq.train.data.tokens import prepare as prep

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    doc = corpus_dir / "a.jsonl"
    doc.write_text(json.dumps({"text": "abcdef"}) + "\n")
    out = tmp_path / "tokens"
    prep.prepare(resolve_corpus(corpus_dir), out, "bytes", progress=False)
    doc.write_text(json.dumps({"text": "ghijkl"}) + "\n")  # the same size, other bytes
    again = prep.prepare(resolve_corpus(corpus_dir), out, "bytes", progress=False)
    assert again.skipped_complete == 0
    assert TokenDataset(out).document(0).tolist()[:-1] == list(b"ghijkl")

    tok = tmp_path / "T"
    write_bytes_tokenizer(tok)
    hf_out = tmp_path / "hf-tokens"
    prep.prepare(resolve_corpus(corpus_dir), hf_out, f"hf:{tok}", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).unlink()
    write_llama3_tokenizer(tok)  # another tokenizer at the same path
    with pytest.raises(OutputDirError, match="whose files have changed since"):
        prep.prepare(resolve_corpus(corpus_dir), hf_out, f"hf:{tok}", progress=False)


def test_a_shard_of_another_input_with_the_same_name_is_refused_not_replaced(
    tmp_path: Path,
) -> None:
    """A/data.jsonl then B/data.jsonl into one --out: both make shard 'data', and same_source compared sizes and
    hashes only, so B's tokens silently replaced A's. Another input is refused naming both; a rerun of A, and A's
    bytes copied elsewhere, still count as complete."""
    from posfreq.scripts.commands import prepare as prepare_cli
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.tokens import prepare as prep

    for name, text in (("A", "from A"), ("B", "from B, longer")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "tokens"
    prep.prepare(resolve_corpus(tmp_path / "A"), out, "bytes", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as refused:
        prepare_cli.main(
            ["--corpus", str(tmp_path / "B"), "--tokenizer", "bytes", "--out", str(out), "--quiet"]
        )
    assert str(refused.value.code) == (
        f"error: {out}/data holds the tokens of {tmp_path / 'A' / 'data.jsonl'}, not of "
        f"{tmp_path / 'B' / 'data.jsonl'}, which would replace them: both inputs take the shard name 'data'. "
        f"Fix: tokenize each corpus into its own --out, or delete {out}/data.* (and {out}/val/data.*) to "
        "replace that shard"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert (
        prep.prepare(resolve_corpus(tmp_path / "A"), out, "bytes", progress=False).skipped_complete
        == 1
    )
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "data.jsonl").write_bytes((tmp_path / "A" / "data.jsonl").read_bytes())
    assert (
        prep.prepare(
            resolve_corpus(tmp_path / "copy"), out, "bytes", progress=False
        ).skipped_complete
        == 1
    )
    assert TokenDataset(out).document(0).tolist()[:-1] == list(b"from A")


def test_a_rerun_checks_its_finished_inputs_in_parallel_with_the_same_answer(
    tmp_path: Path,
) -> None:
    """The rerun's check reads every finished input again (gigabytes per SlimPajama task): `workers` threads read
    them at once, and find the same inputs to redo as one does (here a same-size edit among unchanged files)."""
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.tokens import prepare as prep

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for i in range(6):
        (corpus_dir / f"{i}.jsonl").write_text(json.dumps({"text": f"document {i} " * 50}) + "\n")
    out = tmp_path / "tokens"
    prep.prepare(resolve_corpus(corpus_dir), out, "bytes", progress=False)
    edited = corpus_dir / "3.jsonl"
    edited.write_text(
        edited.read_text().replace("document 3", "document X")
    )  # same size, other bytes
    corpus = resolve_corpus(corpus_dir)
    names = prep.shard_names(corpus.files)
    tokenizer = get_tokenizer("bytes")
    one = pending_files(corpus, names, out, tokenizer, workers=1)
    assert one == [f for f in corpus.files if f.name == "3.jsonl"]
    assert pending_files(corpus, names, out, tokenizer, workers=4) == one


@pytest.mark.slow
def test_a_moved_tokenizer_folder_is_the_same_tokenizer_and_its_shards_name_the_new_path(
    tmp_path: Path,
) -> None:
    """A data folder and its hf:DIR tokenizer moved elsewhere: prepare's rerun refused the shards (they recorded
    the old path), though the tokenizer's files were the same. It now compares by content, keeps every shard's
    tokens, records the new path (array task by array task, the directory stays readable between them), and
    still refuses other tokenizer files at the new path."""
    import shutil

    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer, write_llama3_tokenizer
    from posfreq.train.data.tokens import prepare as prep

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for name in ("a", "b"):
        lines = [json.dumps({"text": f"{name} document {i} " * 3}) for i in range(40)]
        (corpus_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    old_tok, old_out = tmp_path / "old" / "T", tmp_path / "old" / "tokens"
    write_bytes_tokenizer(old_tok)
    prep.prepare(
        resolve_corpus(corpus_dir), old_out, f"hf:{old_tok}", progress=False, val_fraction=0.2
    )
    shutil.move(tmp_path / "old", tmp_path / "new")
    tok, out = tmp_path / "new" / "T", tmp_path / "new" / "tokens"
    tokens = {p: p.read_bytes() for p in sorted(out.rglob("*.bin"))}
    assert len(tokens) == 4  # two shards and their held-out halves

    first = prep.prepare(
        resolve_corpus(corpus_dir), out, f"hf:{tok}", shard=(0, 2), progress=False, val_fraction=0.2
    )
    assert (first.skipped_complete, len(first.relabelled)) == (1, 2)  # one shard and its val shard
    specs = {json.loads((out / f"{n}.json").read_text())["tokenizer"] for n in ("a", "b")}
    assert specs == {f"hf:{old_tok}", f"hf:{tok.resolve()}"}
    assert TokenDataset(out).num_docs > 0  # between the two tasks: one tokenizer by content

    second = prep.prepare(
        resolve_corpus(corpus_dir), out, f"hf:{tok}", shard=(1, 2), progress=False, val_fraction=0.2
    )
    assert (second.skipped_complete, len(second.relabelled)) == (1, 2)
    for directory in (out, out / "val"):
        manifest = json.loads((directory / "manifest.json").read_text())
        assert {s["meta"]["tokenizer"] for s in manifest["shards"]} == {f"hf:{tok.resolve()}"}
        assert TokenDataset(directory).tokenizer == f"hf:{tok.resolve()}"
    assert {p: p.read_bytes() for p in sorted(out.rglob("*.bin"))} == tokens

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).unlink()
    write_llama3_tokenizer(tok)  # other files at the new path: not the tokenizer of these shards
    with pytest.raises(OutputDirError, match="whose files have changed since"):
        prep.prepare(resolve_corpus(corpus_dir), out, f"hf:{tok}", progress=False, val_fraction=0.2)


def test_a_directorys_shards_share_a_tokenizer_by_content_where_they_recorded_it() -> None:
    """share_tokenizer: two specs of one fingerprint agree, two fingerprints under one spec do not, and shards
    without a fingerprint (older prepares) are compared by spec."""
    from posfreq.train.data.tokens.shards import share_tokenizer

    old, new = {"tokenizer": "hf:/old/T"}, {"tokenizer": "hf:/new/T"}
    assert share_tokenizer(
        old | {"tokenizer_fingerprint": "x"}, new | {"tokenizer_fingerprint": "x"}
    )
    assert not share_tokenizer(
        old | {"tokenizer_fingerprint": "x"}, old | {"tokenizer_fingerprint": "y"}
    )
    assert not share_tokenizer(old, new | {"tokenizer_fingerprint": "x"})
    assert share_tokenizer(old, old | {"tokenizer_fingerprint": "x"})
    llama = {"tokenizer": "llama3", "tokenizer_fingerprint": "llama3:quicktok-0.3.0"}
    assert share_tokenizer(
        llama, llama | {"tokenizer_fingerprint": "llama3:quicktok-0.4.0"}
    )  # the same ids


def test_older_shards_relative_tokenizer_path_is_recorded_absolute_task_by_task(
    tmp_path: Path, monkeypatch
) -> None:
    """Shards from before fingerprints, which recorded hf:T as prepare was given it, are relabelled with the
    absolute path when the rerun's tokenizer is that folder (compared by spec: nothing recorded its content) and
    gain no fingerprint they were never checked against. An array task relabels only its own shards: the
    directory, half hf:T and half hf:/abs/T, was refused as two tokenizers, and the task crashed writing the
    manifest."""
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer
    from posfreq.train.data.tokens import prepare as prep

    monkeypatch.chdir(tmp_path)
    write_bytes_tokenizer(tmp_path / "T")
    (tmp_path / "corpus").mkdir()
    for name in ("a", "b"):
        (tmp_path / "corpus" / f"{name}.jsonl").write_text(json.dumps({"text": name * 9}) + "\n")
    out = tmp_path / "out"
    prep.prepare(resolve_corpus(tmp_path / "corpus"), out, "hf:T", progress=False)
    (out / "manifest.json").unlink()
    for name in ("a", "b"):  # as an older prepare wrote them
        meta = json.loads((out / f"{name}.json").read_text())
        del meta["tokenizer_fingerprint"]
        (out / f"{name}.json").write_text(json.dumps(meta | {"tokenizer": "hf:T"}))

    absolute = f"hf:{(tmp_path / 'T').resolve()}"
    first = prep.prepare(
        resolve_corpus(tmp_path / "corpus"), out, "hf:T", shard=(0, 2), progress=False
    )
    assert len(first.relabelled) == 1
    specs = {json.loads((out / f"{n}.json").read_text())["tokenizer"] for n in ("a", "b")}
    assert specs == {"hf:T", absolute}
    assert TokenDataset(out).num_docs == 2  # between the two tasks: one tokenizer
    prep.prepare(resolve_corpus(tmp_path / "corpus"), out, "hf:T", shard=(1, 2), progress=False)
    for name in ("a", "b"):
        meta = json.loads((out / f"{name}.json").read_text())
        assert meta["tokenizer"] == absolute and "tokenizer_fingerprint" not in meta
    assert TokenDataset(out).tokenizer == absolute


def test_a_crash_while_relabelling_leaves_no_manifest_of_the_old_path(
    tmp_path: Path, monkeypatch
) -> None:
    """The rerun rewrote shards' metadata before it removed the manifest: a crash between left a manifest that
    readers trust (it lists the same names) and that still named the folder the data moved from."""
    import shutil

    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer
    from posfreq.train.data.tokens import prepare as prep

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text(json.dumps({"text": "abc"}) + "\n")
    write_bytes_tokenizer(tmp_path / "old" / "T")
    prep.prepare(
        resolve_corpus(tmp_path / "corpus"),
        tmp_path / "old" / "out",
        f"hf:{tmp_path / 'old' / 'T'}",
        progress=False,
    )
    shutil.move(tmp_path / "old", tmp_path / "new")
    out = tmp_path / "new" / "out"
    assert (out / "manifest.json").is_file()

    def crash(*args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr(prep, "write_shard_meta", crash)
    with pytest.raises(OSError, match="killed"):
        prep.prepare(
            resolve_corpus(tmp_path / "corpus"), out, f"hf:{tmp_path / 'new' / 'T'}", progress=False
        )
    assert not (out / "manifest.json").exists()


def test_another_tokenizers_shard_is_refused_even_when_a_changed_setting_would_redo_it(
    tmp_path: Path,
) -> None:
    """A rerun with another --val-fraction redoes each shard; it checked the tokenizer only of shards it kept, so
    another tokenizer's shards were re-tokenized in place (the directory then mixed two tokenizers' shards as
    the tasks went) instead of being refused."""
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.hf_tokenizer import write_llama3_tokenizer
    from posfreq.train.data.tokens import prepare as prep

    (tmp_path / "corpus").mkdir()
    lines = [json.dumps({"text": f"document {i}"}) for i in range(20)]
    (tmp_path / "corpus" / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    prep.prepare(resolve_corpus(tmp_path / "corpus"), out, "bytes", progress=False)
    before = {p.name: p.read_bytes() for p in out.glob("a.*")}
    write_llama3_tokenizer(tmp_path / "L")
    with pytest.raises(OutputDirError, match="tokenized with 'bytes'.*fresh --out"):
        prep.prepare(
            resolve_corpus(tmp_path / "corpus"),
            out,
            f"hf:{tmp_path / 'L'}",
            progress=False,
            val_fraction=0.2,
        )
    assert {p.name: p.read_bytes() for p in out.glob("a.*")} == before
    assert not (out / "val").exists()  # refused before the held-out folder is claimed


def test_a_users_file_in_an_existing_val_folder_is_refused_before_the_inputs_are_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held-out folder is claimed late only when it is new; an existing one holding a user's file is refused at
    once, not after re-hashing every input (gigabytes per SlimPajama task), and nothing is written."""
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.tokens import prepare as prep

    (tmp_path / "corpus").mkdir()
    lines = [json.dumps({"text": f"document {i}"}) for i in range(20)]
    (tmp_path / "corpus" / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    prep.prepare(
        resolve_corpus(tmp_path / "corpus"), out, "bytes", progress=False, val_fraction=0.2
    )
    (out / "val" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in (out / "val").iterdir())

    def hashed(*args, **kwargs):
        raise AssertionError("the inputs were hashed before the val folder was checked")

    monkeypatch.setattr(prep, "pending_files", hashed)
    with pytest.raises(OutputDirError, match="notes.txt"):
        prep.prepare(
            resolve_corpus(tmp_path / "corpus"), out, "bytes", progress=False, val_fraction=0.2
        )
    assert sorted(p.name for p in (out / "val").iterdir()) == before


def test_a_relative_spec_without_fingerprint_needs_the_same_ids_too() -> None:
    """A relative hf:tok recorded without a fingerprint resolves against this process's directory, maybe not the
    one prepare ran in: a tokenizer of other ids found there was taken as the shards' own."""
    from posfreq.train.data.tokens.shards import share_tokenizer

    old = {"tokenizer": "hf:tok", "vocab_size": 258, "eos_id": 257}
    assert share_tokenizer(old, dict(old))
    assert not share_tokenizer(old, old | {"vocab_size": 128256, "eos_id": 128001})
    assert share_tokenizer(old, {"tokenizer": "hf:tok"})  # where one side records no ids: by spec


def test_a_built_in_tokenizer_under_another_package_version_is_itself() -> None:
    """llama3's fingerprint names quicktok's version (for result keys); a checkpoint trained under another version
    was refused by every reader, and an override of the same tokenizer too, though the ids are the spec's."""
    from types import SimpleNamespace

    from posfreq.train.data.hf_tokenizer import same_tokenizer

    live = SimpleNamespace(fingerprint="llama3:quicktok-0.4.0")
    assert same_tokenizer("llama3:quicktok-0.3.0", live)
    assert not same_tokenizer("bytes", live)
    assert not same_tokenizer("hf-sha256:00", live)
