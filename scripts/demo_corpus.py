"""The demo's synthetic training corpus and small tokenizer: NIAH-format documents on half the PG essays.

Why: tiny models trained for minutes on a CPU only learn needle retrieval when the training data
teaches it directly. Every document here is a needle task in the probe's own template (the
instruction, haystack sentences with needles "One of the magic numbers is NNNNNN.", the question,
"The numbers are" and the answer), but on the *training half* of the Paul Graham essays (sorted
by name; the probe uses the other half, see `probe_haystack_dir`) and with needle numbers from
an RNG stream that the probe never uses. Document lengths are skewed (log-normal: many short,
some long), as in natural corpora, so the packer's cut at L decides which distances are trained.

The tokenizer is a byte-level BPE trained on the training half, plus the 1,000 three-digit
tokens "000".."999" (a 6-digit needle is two nearly unique tokens), "<s>" and "</s>".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from analysis.niah import ANSWER_PREFIX, INSTRUCTION, NEEDLE, QUESTION, clean_haystack, split_sentences

BOS, EOS = "<s>", "</s>"
NUMBER_TOKENS = [f"{i:03d}" for i in range(1000)]
NEEDLES_PER_DOC = 4


def split_essays(n_train: int = 24) -> tuple[list[str], list[str]]:
    """The PG essays sorted by name, split into (training texts, probe texts)."""
    from analysis.corpora import pg_essays

    docs = sorted(pg_essays(), key=lambda d: d.source)
    texts = [d.text for d in docs]
    return texts[:n_train], texts[n_train:]


def probe_haystack_dir(out_dir: str | Path, n_train: int = 24) -> Path:
    """Write the probe half of the essays as .txt files (a haystack for analysis.niah); returns the dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(split_essays(n_train)[1]):
        (out / f"essay_{i:02d}.txt").write_text(text, encoding="utf-8")
    return out


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024, n_train: int = 24) -> str:
    """Train the demo BPE on the training-half essays, save tokenizer.json in out_dir; returns 'hf:<dir>'."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = [clean_haystack(t) for t in split_essays(n_train)[0]]
    texts.append(" ".join([INSTRUCTION, NEEDLE, QUESTION, ANSWER_PREFIX]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in NUMBER_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return f"hf:{out}"


def _sentences(texts: list[str]) -> list[str]:
    """Digit-free sentences of the training texts, in order."""
    return [s for t in texts for s in split_sentences(clean_haystack(t))]


def niah_document(rng: np.random.Generator, sentences: list[str], n_sentences: int) -> str:
    """One training document: the probe's template on `n_sentences` training sentences, 4 needles, answer."""
    start = int(rng.integers(len(sentences)))
    body = [sentences[(start + i) % len(sentences)] for i in range(n_sentences)]
    numbers = [str(n) for n in rng.choice(900_000, size=NEEDLES_PER_DOC, replace=False) + 100_000]
    where = ((np.arange(NEEDLES_PER_DOC) + rng.random(NEEDLES_PER_DOC)) / NEEDLES_PER_DOC * n_sentences).astype(int)
    parts: list[str] = []
    for k in range(n_sentences + 1):
        parts += [NEEDLE.format(numbers[j]) for j in range(NEEDLES_PER_DOC) if where[j] == k]
        if k < n_sentences:
            parts.append(body[k])
    answer = ", ".join(numbers[:-1]) + " and " + numbers[-1] + "."
    return f"{INSTRUCTION}\n\n{' '.join(parts)}\n\n{QUESTION}\n{ANSWER_PREFIX} {answer}\n"


def document_sentences(rng: np.random.Generator, n_docs: int, median: float, sigma: float, max_sentences: int) -> np.ndarray:
    """Skewed (log-normal) haystack sizes in sentences: many short documents, a few long ones."""
    sizes = np.exp(np.log(median) + sigma * rng.standard_normal(n_docs))
    return np.clip(np.rint(sizes), 1, max_sentences).astype(int)


def write_corpus(
    out_dir: str | Path,
    n_docs: int,
    seed: int = 1234,
    median_sentences: float = 6.0,
    sigma: float = 1.0,
    max_sentences: int = 200,
    n_train: int = 24,
) -> Path:
    """Write n_docs NIAH-format documents to out_dir/demo_corpus.jsonl ({"text": ...} per line)."""
    rng = np.random.default_rng([seed, 0x5EED])
    sentences = _sentences(split_essays(n_train)[0])
    sizes = document_sentences(rng, n_docs, median_sentences, sigma, max_sentences)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo_corpus.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for n in sizes:
            f.write(json.dumps({"text": niah_document(rng, sentences, int(n))}) + "\n")
    return path
