"""Tokenizers: exact Llama-3 ids offline, round trips, the hf:<dir> adapter."""

from __future__ import annotations

import json

import pytest

from posfreq.train.data.tokenizer import get_tokenizer


def test_llama3_known_ids():
    tok = get_tokenizer("llama3")
    assert tok.encode("Hello world!") == [9906, 1917, 0]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (128000, 128001, 128256)


@pytest.mark.parametrize("spec", ["llama3", "bytes"])
def test_round_trip_and_batch(spec):
    tok = get_tokenizer(spec)
    texts = ["The grass is green. 144231!", "naïve café — 日本語", "", "<|end_of_text|> stays text"]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    assert [list(a) for a in tok.encode_batch(texts)] == [tok.encode(t) for t in texts]


def test_special_token_strings_are_plain_text():
    tok = get_tokenizer("llama3")
    assert tok.eos_id not in tok.encode("a <|end_of_text|> b")


def test_hf_directory_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    tok = get_tokenizer(f"hf:{tmp_path}")
    assert tok.encode("hello world") == [3, 4]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 5)


def test_unknown_and_missing_tokenizers_are_clear(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("gpt5")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        get_tokenizer(f"hf:{tmp_path}")


def test_hf_tokenizer_keeps_special_strings_as_text(tmp_path):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens([AddedToken("</s>", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = get_tokenizer(f"hf:{tmp_path}")
    assert tok.eos_id not in tok.encode("a </s> a")
