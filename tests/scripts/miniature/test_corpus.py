"""The demo's tokenizer and corpora: exact round trips, positional digit ids, probe needles kept out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posfreq.analysis.niah.needles import (
    NiahBuilder,
    PromptFormat,
    clean_haystack,
    probe_needles,
    split_sentences,
)
from posfreq.analysis.niah.scoring import extract_numbers
from posfreq.scripts.miniature import corpus as demo_corpus
from posfreq.train.data.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(demo_corpus.build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_round_trip_and_positional_digit_ids(tokenizer):
    for text in [
        "One of the magic numbers is 424727.",
        "naïve café — 日本語 1234567 <s>",
        "\n\n  x  y\n",
        "",
    ]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    first, second = tokenizer.encode("424727")[-2:], tokenizer.encode("727424")[-2:]
    assert (
        first[0] != second[1] and first[1] != second[0]
    )  # "424" leading vs continuing: different ids
    assert tokenizer.decode(first) == "424727"


@pytest.mark.slow
def test_the_build_is_reproducible(tmp_path):
    a = demo_corpus.build_tokenizer(tmp_path / "a")[3:]
    b = demo_corpus.build_tokenizer(tmp_path / "b")[3:]
    assert (Path(a) / "tokenizer.json").read_bytes() == (Path(b) / "tokenizer.json").read_bytes()


def test_probe_prompts_build_and_answers_parse(tokenizer, tmp_path):
    from posfreq.analysis.niah.decoding import reference_answer
    from posfreq.scripts.miniature.settings import FULL

    budget = FULL.answer_budget
    builder = NiahBuilder(
        tokenizer, demo_corpus.probe_haystack_dir(tmp_path / "hay"), PromptFormat(budget, bos=False)
    )
    assert builder.min_length() <= min(FULL.test_lengths)
    for test in builder.make_tests(256, 3, seed=0):
        assert len(test.input_ids) == 256 - budget and tokenizer.bos_id not in test.input_ids
        ids, spans = reference_answer(tokenizer, test, "nearest_first")
        assert len(ids) < budget  # the answer and its EOS fit in the demo's answer budget
        assert extract_numbers(tokenizer.decode(ids)) == list(test.needles[::-1])
        assert all(
            b - a == 2 for a, b in spans
        )  # positional three-digit ids: two tokens per needle


def test_corpus_excludes_probe_needles_and_uses_the_training_half(tmp_path):
    exclude = frozenset(probe_needles([128, 256], 8, seed=0))
    path = demo_corpus.write_corpus(tmp_path, 300, seed=5, exclude_numbers=exclude)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(texts) == 300
    numbers = {n for t in texts for n in extract_numbers(t)}
    assert numbers and not numbers & exclude
    train_sentences = set(demo_corpus.training_sentences())
    probe_only = {
        s
        for text in demo_corpus.split_essays()[1]
        for s in split_sentences(clean_haystack(text))
        if len(s) > 40
    } - train_sentences
    assert len(probe_only) > 1000
    body = "\n".join(texts)
    assert not [s for s in probe_only if s in body]
    assert sum(s in body for s in list(train_sentences)[:2000]) > 0
