"""NIAH construction and scoring, checked against the haystack's own sentences and string search."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from posfreq.analysis.niah.needles import (
    ANSWER_PREFIX,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    Haystack,
    NiahBuilder,
    NiahTest,
    PromptFormat,
    clean_haystack,
    load_haystack,
    make_tests,
    split_sentences,
)
from posfreq.analysis.niah.scoring import score_answer
from posfreq.train.data.tokenizer import get_tokenizer

HEAD = INSTRUCTION + "\n\n"
TAIL = "\n\n" + QUESTION + "\n" + ANSWER_PREFIX
FORMAT = PromptFormat(
    answer_budget=16
)  # a short budget keeps the short lengths of these tests possible


@pytest.fixture(scope="module")
def builders() -> dict[str, NiahBuilder]:
    """One builder per tokenizer on the embedded PG essays (tokenized once for the module)."""
    haystack = load_haystack("pg")
    return {
        name: NiahBuilder(get_tokenizer(name), haystack, FORMAT) for name in ("llama3", "bytes")
    }


def check_test(test: NiahTest, builder: NiahBuilder) -> None:
    """Check a test against an independent reading of its text: length, needles, quarters, boundaries."""
    tok = builder.tokenizer
    ids = test.input_ids
    assert len(ids) == test.prompt_length == test.length - test.answer_budget
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:].tolist()
    assert tok.decode(ids[1:].tolist()) == test.prompt
    assert test.prompt.startswith(HEAD) and test.prompt.endswith(TAIL)
    assert tok.decode(ids[test.question_position :].tolist()) == TAIL

    assert len(set(test.needles)) == 4 and all(re.fullmatch(r"[1-9]\d{5}", n) for n in test.needles)
    body = test.prompt[len(HEAD) : -len(TAIL)]
    needle_texts = [" " + NEEDLE.format(n) for n in test.needles]
    for number, text in zip(test.needles, needle_texts):
        assert test.prompt.count(number) == 1 and body.count(text) == 1

    # Needle token positions: the needle's own tokens start there, the prompt text before it matches.
    assert list(test.positions) == sorted(test.positions)
    for pos, text, depth in zip(test.positions, needle_texts, test.depths):
        width = len(tok.encode(text))
        assert tok.decode(ids[pos : pos + width].tolist()) == text
        assert tok.decode(ids[1:pos].tolist()) == test.prompt[: test.prompt.index(text)]
        assert depth == pos / test.prompt_length

    # Haystack: whole sentences from the start (cycled), the last one possibly cut.
    sentences = builder.haystack.sentences
    n = test.n_sentences
    chunks = re.split("|".join(re.escape(t) for t in needle_texts), body)
    haystack_text = "".join(chunks)
    whole = "".join(" " + sentences[i % len(sentences)] for i in range(max(n - 1, 0)))
    assert haystack_text.startswith(whole)
    last = haystack_text[len(whole) :]  # a prefix of the next sentence, maybe padded with spaces
    next_sentence = " " + sentences[(n - 1) % len(sentences)]
    assert (n == 0 and last == "") or (last != "" and next_sentence.startswith(last.rstrip(" ")))

    # Needle j sits at a sentence boundary, in a sentence slot that meets the j-th quarter.
    for j in range(4):
        before = "".join(chunks[: j + 1])
        prefixes = (
            "".join(" " + sentences[i % len(sentences)] for i in range(k)) for k in range(n + 1)
        )
        k = next(k for k, prefix in enumerate(prefixes) if prefix == before)
        assert k == test.sentence_index[j]
        if n:
            assert j / 4 < (k + 1) / n and k / n < (j + 1) / 4


@pytest.mark.parametrize(
    "name, lengths",
    [("llama3", [128, 200, 257, 512, 1000]), ("bytes", [400, 512, 777, 1000, 2048])],
)
def test_exact_length_needles_and_boundaries(builders, name, lengths):
    builder = builders[name]
    for length in lengths:
        for test in builder.make_tests(length, n_tests=6, seed=3):
            check_test(test, builder)


def test_llama3_segments_equal_canonical_tokenization(builders):
    """The separately tokenized segments are what encoding the whole prompt text would give."""
    tok = builders["llama3"].tokenizer
    for length in (300, 1000, 2048):
        for test in builders["llama3"].make_tests(length, n_tests=5, seed=11):
            assert tok.encode(test.prompt) == test.input_ids[1:].tolist()


def test_noise_haystack_cycles_to_exact_length():
    builder = NiahBuilder(get_tokenizer("llama3"), "noise", FORMAT)
    assert len(builder.haystack.sentences) == 5
    for test in builder.make_tests(1000, n_tests=3, seed=0):
        check_test(test, builder)


def test_cut_sentence_never_splits_a_character(tmp_path: Path):
    words = ["Ünïcödé", "wörds", "—", "“quoted”", "☃", "snow", "plain", "text"]
    text = " ".join(" ".join(words[(i * j) % 8] for j in range(i % 9 + 2)) + "." for i in range(40))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    builder = NiahBuilder(get_tokenizer("bytes"), tmp_path, FORMAT)
    padded = 0
    for length in range(400, 480):
        test = builder.build(length, seed=0, index=0)
        assert "\ufffd" not in test.prompt
        check_test(test, builder)
        padded += test.prompt.endswith("  " + TAIL)
    assert padded  # some cuts fell inside a character and were padded


def test_same_seed_same_tests_different_seed_different(builders):
    first = make_tests(get_tokenizer("llama3"), 300, 4, seed=7, prompt_format=FORMAT)
    again = builders["llama3"].make_tests(300, 4, seed=7)
    other = builders["llama3"].make_tests(300, 4, seed=8)
    assert [t.prompt_sha256 for t in first] == [t.prompt_sha256 for t in again]
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(first, again))
    assert len({t.prompt_sha256 for t in first}) == 4  # fresh needles per test
    assert not {t.prompt_sha256 for t in first} & {t.prompt_sha256 for t in other}
    assert first[0].haystack_sha256 == load_haystack("pg").sha256
    # Needles depend on (seed, length, index) only, and numpy's default_rng streams are stable: pin one draw.
    assert builders["bytes"].build(512, 0, 0).needles == builders["llama3"].build(512, 0, 0).needles
    assert builders["llama3"].build(256, 0, 0).needles == ("424727", "930207", "441642", "665416")


def test_digits_removed_from_haystack(tmp_path: Path):
    assert (
        clean_haystack("In 2010 he had 7 cats.[12] Call 144231 now.") == "In he had cats. Call now."
    )
    assert split_sentences('One. Two? Three!Four "Five." Six.Seven') == [
        "One.",
        "Two?",
        "Three!",
        'Four "Five."',
        "Six.",
        "Seven",
    ]
    file = tmp_path / "numbers.txt"
    file.write_text(" ".join(f"Item {100000 + i} costs {i} dollars." for i in range(500)))
    haystack = load_haystack(file)
    assert not re.search(r"\d", haystack.text) and haystack.name == str(file)
    builder = NiahBuilder(get_tokenizer("llama3"), haystack, FORMAT)
    for test in builder.make_tests(400, 5, seed=1):
        check_test(test, builder)


def test_haystack_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not 'pg', 'noise'"):
        load_haystack(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no text left"):
        Haystack.from_text("digits", "123 456")


@pytest.mark.parametrize("name, length", [("llama3", 64), ("bytes", 128), ("bytes", 300)])
def test_too_short_length_raises(builders, name, length):
    with pytest.raises(ValueError, match=f"NIAH length {length} is too short"):
        builders[name].build(length, seed=0, index=0)


@pytest.fixture(scope="module")
def test0(builders) -> NiahTest:
    return builders["llama3"].build(512, seed=0, index=0)


def test_records_are_json_ready(test0):
    import json

    json.dumps(test0.record())
    json.dumps(score_answer(test0, " nothing").record())


def test_probe_needles_are_exactly_the_tests_needles():
    from posfreq.analysis.niah.needles import probe_needles

    builder = NiahBuilder(get_tokenizer("llama3"), "noise", FORMAT)
    built = {
        n
        for length in (128, 256)
        for test in builder.make_tests(length, 5, seed=3)
        for n in test.needles
    }
    assert probe_needles([128, 256], 5, seed=3) == built
    assert len(built) == 2 * 5 * 4  # fresh numbers for every test
