"""The demo's synthetic training corpus and small tokenizer: needle tasks on half the PG essays.

Why: tiny models trained for minutes on a CPU only learn needle retrieval when the training data
teaches it directly, and only after an induction (copy) circuit exists. So the demo trains in two
phases, both written here as JSON-lines corpora ({"text": ...} per line):

- warm-up (`WARMUP`): dense induction drills, a random digit string of 4-16 three-digit tokens
  repeated on 4 lines (the random length makes the copy distance vary, so only content matching
  predicts the repeats, not a fixed offset);
- main (`CorpusMix()`): a stationary mix of those drills, answer-line copies, short needle drills
  (0-2 haystack sentences) and needle documents with log-normal (skewed: many short, a few long)
  haystack sizes. Needle documents use the probe's own template (instruction, haystack sentences
  with "One of the magic numbers is NNNNNN.", question, "The numbers are", answer), but on the
  *training half* of the Paul Graham essays (sorted by name; the probe uses the other half, see
  `probe_haystack_dir`) and with numbers from `default_rng([seed, 0x5EED])`, a stream the probe's
  `default_rng([seed, length, index])` never produces. The answer lists the needles nearest-first
  (`reverse_answer`): a recency preference is what RoPE attention finds easiest.

The tokenizer (`build_tokenizer`) is a byte-level WordPiece learnt on the training half (the
template weighted so its words are single pieces) whose digit runs are split into three-digit
pieces with *positional* ids: "424727" is "424", "⁂727". A needle's second half thus never shares
an id with a first half, so the model cannot write it by re-copying the first half (the failure of
a plain "000".."999" vocabulary: "665665"); it must copy what followed the first half (induction).

Why configs/demo.yaml gives the model 8 heads with no key/value sharing, and an 800-step warm-up: retrieval
needs a copy (induction) circuit, which must form during the warm-up on every seed (docs/demo.md, "How the
corpus was tuned").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posfreq.analysis.niah.needles import (
    ANSWER_PREFIX,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    answer_text,
    clean_haystack,
    split_sentences,
)
from posfreq.train.journal import record_written

BOS, EOS, UNK = "<s>", "</s>", "<unk>"  # UNK is never produced: every byte has a piece
CONTINUATION = (
    "\u2042"  # "⁂" marks a piece that continues a word; no byte-level symbol is this character
)
NUMBER_TOKENS = [f"{i:03d}" for i in range(1000)]  # a digit run's first three digits
CONTINUED_NUMBER_TOKENS = [
    CONTINUATION + t for t in NUMBER_TOKENS
]  # its later three-digit groups: other ids
NEEDLES_PER_DOC = 4
TEMPLATE_WEIGHT = 200  # the template counts as this many copies when learning the tokenizer: its words become single tokens
N_TRAIN_ESSAYS = 24  # essays 0..23 (sorted by name) are training haystack, 24..48 the probe's
SEED_SALT = 0x5EED  # training numbers come from default_rng([seed, SEED_SALT]); the probe uses 3-entry seeds


@dataclass(frozen=True)
class CorpusMix:
    """Fractions of each document kind (the rest are skewed needle documents) and their parameters."""

    digit_copy: float = 0.25
    line_copy: float = 0.15
    drill: float = 0.35
    drill_max_sentences: int = 2
    median_sentences: float = 3.0
    sigma: float = 0.8
    max_sentences: int = 200
    copy_min_chunks: int = 4
    copy_max_chunks: int = 16
    copies: int = 4
    reverse_answer: bool = True

    def __post_init__(self) -> None:
        fractions = (self.digit_copy, self.line_copy, self.drill)
        if min(fractions) < 0 or sum(fractions) > 1 + 1e-9:
            raise ValueError(f"CorpusMix fractions {fractions} must be >= 0 and sum to at most 1")


WARMUP = CorpusMix(digit_copy=1.0, line_copy=0.0, drill=0.0)


def split_essays(n_train: int = N_TRAIN_ESSAYS) -> tuple[list[str], list[str]]:
    """The PG essays sorted by name, split into (training texts, probe texts)."""
    from posfreq.train.data.essays import pg_essays

    texts = [d.text for d in sorted(pg_essays(), key=lambda d: d.source)]
    return texts[:n_train], texts[n_train:]


def probe_haystack_dir(out_dir: str | Path, n_train: int = N_TRAIN_ESSAYS) -> Path:
    """Write the probe half of the essays as .txt files (a haystack for analysis.niah.needles); returns the dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(split_essays(n_train)[1]):
        record_written(out / f"essay_{i:02d}.txt")
        (out / f"essay_{i:02d}.txt").write_text(text, encoding="utf-8")
    return out


def _learn_pieces(words: list[str], vocab_size: int) -> list[str]:
    """About `vocab_size` word pieces ("⁂" + s for a piece inside a word) learnt by byte-level BPE, reproducibly.

    WordPiece learning is BPE in which a symbol inside a word differs from the same symbol starting
    one; `tokenizers`' WordPieceTrainer numbers those inner symbols in hash order, so ties (and the
    vocabulary) change from run to run. Here inner symbols are private-use characters known in
    advance, which the deterministic BpeTrainer treats like any other.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = {c: chr(0xE000 + i) for i, c in enumerate(alphabet)}
    outer = {v: k for k, v in inner.items()}
    learner = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet + list(inner.values()), show_progress=False
    )
    learner.train_from_iterator((w[0] + "".join(inner[c] for c in w[1:]) for w in words), trainer)
    learnt = [p for p, _ in sorted(learner.get_vocab().items(), key=lambda item: item[1])]
    return [
        (CONTINUATION if p[0] in outer else "") + "".join(outer.get(c, c) for c in p)
        for p in learnt
    ]


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = 2048, n_train: int = N_TRAIN_ESSAYS
) -> str:
    """Build the demo tokenizer from the training-half essays, save tokenizer.json in out_dir; returns 'hf:<dir>'.

    A byte-level WordPiece: text is split into byte-level words (digit runs split off on their own),
    each word into greedy longest-match pieces, continuation pieces prefixed with CONTINUATION. The
    ~`vocab_size` text pieces are learnt on the essays (digit pieces dropped); all 256 byte symbols
    in both forms keep any text encodable, and decoding drops the prefix, so decode(encode(x)) == x.
    A 6-digit needle "424727" becomes "424", "⁂727": its halves have different ids, so the model
    cannot produce the second half by re-copying the first; it must copy what followed it.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = [clean_haystack(t) for t in split_essays(n_train)[0]]
    texts += [" ".join([INSTRUCTION, NEEDLE, QUESTION, ANSWER_PREFIX])] * TEMPLATE_WEIGHT
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    words = [w for t in texts for w, _ in pre.pre_tokenize_str(t)]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = [BOS, EOS, UNK] + [
        p for p in _learn_pieces(words, vocab_size) if not any(c.isdigit() for c in p)
    ]
    pieces += (
        alphabet + [CONTINUATION + c for c in alphabet] + NUMBER_TOKENS + CONTINUED_NUMBER_TOKENS
    )
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(
        models.WordPiece(
            vocab,
            unk_token=UNK,
            continuing_subword_prefix=CONTINUATION,
            max_input_chars_per_word=10**6,
        )
    )
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Sequence([decoders.Replace(CONTINUATION, ""), decoders.ByteLevel()])
    record_written(out / "tokenizer.json")
    tok.save(str(out / "tokenizer.json"))
    record_written(out / "tokenizer_config.json")
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return f"hf:{out}"


def training_sentences(n_train: int = N_TRAIN_ESSAYS) -> list[str]:
    """Digit-free sentences of the training-half essays, in order (the training haystack)."""
    return [s for t in split_essays(n_train)[0] for s in split_sentences(clean_haystack(t))]


def _numbers(rng: np.random.Generator, exclude: frozenset[str] = frozenset()) -> list[str]:
    """4 distinct 6-digit numbers, none in `exclude` (e.g. the probe's needles)."""
    while True:
        numbers = [
            str(n) for n in rng.choice(900_000, size=NEEDLES_PER_DOC, replace=False) + 100_000
        ]
        if not exclude.intersection(numbers):
            return numbers


def niah_document(
    rng: np.random.Generator,
    sentences: list[str],
    n_sentences: int,
    reverse: bool = True,
    exclude: frozenset[str] = frozenset(),
) -> str:
    """One needle document: the probe's template on `n_sentences` training sentences, 4 needles, the answer.

    Needle j goes before sentence floor(d_j * n) with d_j uniform in [j/4, (j+1)/4), as in the probe.
    """
    start = int(rng.integers(len(sentences)))
    body = [sentences[(start + i) % len(sentences)] for i in range(n_sentences)]
    numbers = _numbers(rng, exclude)
    where = (
        (np.arange(NEEDLES_PER_DOC) + rng.random(NEEDLES_PER_DOC)) / NEEDLES_PER_DOC * n_sentences
    ).astype(int)
    parts: list[str] = []
    for k in range(n_sentences + 1):
        parts += [NEEDLE.format(numbers[j]) for j in range(NEEDLES_PER_DOC) if where[j] == k]
        if k < n_sentences:
            parts.append(body[k])
    answer = answer_text(numbers[::-1] if reverse else numbers)
    return f"{INSTRUCTION}\n\n{' '.join(parts)}\n\n{QUESTION}\n{ANSWER_PREFIX}{answer}\n"


def line_copy_document(rng: np.random.Generator, exclude: frozenset[str] = frozenset()) -> str:
    """A copy drill in the answer's format: "The numbers are A, B, C and D." twice."""
    line = f"{ANSWER_PREFIX}{answer_text(_numbers(rng, exclude))}\n"
    return line + line


def digit_copy_document(
    rng: np.random.Generator, min_chunks: int = 4, max_chunks: int = 16, copies: int = 4
) -> str:
    """An induction drill: a random digit string of min..max three-digit tokens, on `copies` lines."""
    n = int(rng.integers(min_chunks, max_chunks + 1))
    digits = "".join(f"{x:03d}" for x in rng.integers(1000, size=n))
    return f"{digits}\n" * copies


def generate_documents(
    rng: np.random.Generator,
    n_docs: int,
    sentences: list[str],
    mix: CorpusMix,
    exclude: frozenset[str] = frozenset(),
) -> list[str]:
    """n_docs documents of the mix's kinds, drawn independently; no needle number is in `exclude`."""
    docs = []
    cut_copy, cut_line = mix.digit_copy, mix.digit_copy + mix.line_copy
    cut_drill = cut_line + mix.drill
    for _ in range(n_docs):
        kind = rng.random()
        if kind < cut_copy:
            docs.append(
                digit_copy_document(rng, mix.copy_min_chunks, mix.copy_max_chunks, mix.copies)
            )
        elif kind < cut_line:
            docs.append(line_copy_document(rng, exclude))
        elif kind < cut_drill:
            docs.append(
                niah_document(
                    rng,
                    sentences,
                    int(rng.integers(mix.drill_max_sentences + 1)),
                    mix.reverse_answer,
                    exclude,
                )
            )
        else:
            size = np.exp(np.log(mix.median_sentences) + mix.sigma * rng.standard_normal())
            n = int(np.clip(np.rint(size), 1, mix.max_sentences))
            docs.append(niah_document(rng, sentences, n, mix.reverse_answer, exclude))
    return docs


def write_corpus(
    out_dir: str | Path,
    n_docs: int,
    seed: int = 1234,
    mix: CorpusMix = CorpusMix(),
    name: str = "demo_corpus",
    n_train: int = N_TRAIN_ESSAYS,
    exclude_numbers: frozenset[str] = frozenset(),
) -> Path:
    """Write n_docs documents to out_dir/<name>.jsonl ({"text": ...} per line); returns its path.

    Pass the probe's needles as `exclude_numbers` so that no probe number is ever a training needle.
    Keep out_dir free of other .txt/.json files: corpus readers take every such file in a directory.
    """
    rng = np.random.default_rng([seed, SEED_SALT])
    docs = generate_documents(
        rng, n_docs, training_sentences(n_train), mix, frozenset(exclude_numbers)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.jsonl"
    record_written(path)
    with path.open("w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Write the demo's tokenizer, warm-up and main corpora and the probe haystack under --out."""
    import argparse

    from posfreq.analysis.niah.needles import probe_needles

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory for tokenizer/, warmup/, main/, validation/, probe_haystack/",
    )
    parser.add_argument("--docs", type=int, required=True, help="documents in the main corpus")
    parser.add_argument(
        "--warmup-docs", type=int, required=True, help="documents in the warm-up corpus"
    )
    parser.add_argument(
        "--val-docs",
        type=int,
        default=0,
        help="documents in the held-out validation corpus (the main corpus's mix, its own numbers)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="corpus seed (never a probe seed)")
    parser.add_argument(
        "--probe-lengths",
        type=int,
        nargs="*",
        default=[],
        help="lengths the probe will test: their needles are kept out of training",
    )
    parser.add_argument("--probe-tests", type=int, default=0, help="tests per probe length")
    parser.add_argument("--probe-seeds", type=int, nargs="*", default=[0], help="the probe's seeds")
    args = parser.parse_args(argv)
    exclude = frozenset(
        n
        for seed in args.probe_seeds
        for n in probe_needles(args.probe_lengths, args.probe_tests, seed)
    )
    spec = build_tokenizer(args.out / "tokenizer")
    warmup = write_corpus(
        args.out / "warmup", args.warmup_docs, seed=args.seed, mix=WARMUP, name="warmup"
    )
    main_corpus = write_corpus(
        args.out / "main", args.docs, seed=args.seed + 1, exclude_numbers=exclude
    )
    # validation: a third stream (seed + 2), so the warm-up and main corpora are the same with or without it
    validation = (
        write_corpus(
            args.out / "validation",
            args.val_docs,
            seed=args.seed + 2,
            exclude_numbers=exclude,
            name="validation",
        )
        if args.val_docs
        else None
    )
    haystack = probe_haystack_dir(args.out / "probe_haystack")
    print(
        f"tokenizer {spec}\nwarm-up corpus {warmup}\nmain corpus {main_corpus} ({len(exclude)} probe needles "
        f"excluded)\nvalidation corpus {validation or 'none'}\nprobe haystack {haystack}"
    )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
