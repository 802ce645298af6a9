"""Needle-in-a-haystack (4 needles) test construction and scoring, as in the paper's Table 5.

A test of length n is a prompt of n - B tokens followed by an answer budget of B tokens
(default 128, the official script's), so that no answer token sits at a position >= n. The
prompt, as token ids, is the concatenation of separately tokenized segments::

    [BOS] [CHAT PREFIX] INSTRUCTION "\\n\\n" | " sentence" ... " One of the magic numbers is NNNNNN." ... | TAIL

where TAIL is "\\n\\n" QUESTION, then "\\n" (or the chat template's end of the user turn and
start of the assistant's) and ANSWER_PREFIX. BOS is prepended when asked (`PromptFormat`);
a chat template frames the user message and never adds a BOS of its own making. Needle j
(0-based) goes before haystack sentence floor(d_j * n_s) with d_j drawn uniformly in
[j/4, (j+1)/4) and n_s the number of haystack sentences in the prompt, as in the official STRING
script. The haystack is taken from its start (cycling when it is too short); whole sentences are
added while they fit and the last one is cut at the token level so that the prompt is exactly
n - B tokens (a cut that would split a character keeps the whole characters before it and pads
with space tokens).

Scoring keeps only the generated continuation (a leading echo of the prompt is dropped) and
counts the needles among its 6-digit numbers, anywhere in the answer (the official script's
rule: list answers, prose and extra numbers all count what they contain); the stricter
first-line rule (cut at the first newline after a digit) is kept beside it. A test passes when
at least `min_retrieved` (default 2) of the 4 needles are found.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from posfreq.train.data.tokenizer import Tokenizer

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
NEEDLE = "One of the magic numbers is {}."
QUESTION = "What are the magic numbers mentioned in the provided text?"
ANSWER_PREFIX = "The numbers are"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
N_NEEDLES = 4
ANSWER_BUDGET = 128  # the official script's greedy answer budget, inside the test length

_HEAD = INSTRUCTION + "\n\n"
_QUESTION = "\n\n" + QUESTION
_TAIL = _QUESTION + "\n" + ANSWER_PREFIX
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+|(?<=[.!?])(?=[A-Z][a-z])")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences after . ! ? (also where a paragraph break lost its space)."""
    return [s for s in (part.strip() for part in _SENTENCE_END.split(text)) if s]


def clean_haystack(text: str) -> str:
    """Drop footnote marks and digit runs (no needle can collide with a number); tidy the whitespace left."""
    text = re.sub(r"\[\d+\]", "", text)
    text = re.sub(r"\d+", "", text).replace("\ufffd", "")
    return re.sub(r" ([.,;:!?])", r"\1", " ".join(text.split()))


@dataclass(frozen=True)
class Haystack:
    """Cleaned filler text, its sentences, and the sha256 of the cleaned text (for provenance)."""

    name: str
    text: str
    sentences: tuple[str, ...]
    sha256: str

    @classmethod
    def from_text(cls, name: str, text: str) -> Haystack:
        """Clean `text` and split it into sentences."""
        cleaned = clean_haystack(text)
        sentences = tuple(split_sentences(cleaned))
        if not sentences:
            raise ValueError(f"haystack {name!r} has no text left after removing digits and blanks")
        return cls(name, cleaned, sentences, hashlib.sha256(cleaned.encode("utf-8")).hexdigest())


def load_haystack(spec: str | Path = "pg") -> Haystack:
    """`pg` (embedded Paul Graham essays), `noise` (passkey filler), a .txt file or a directory of them."""
    if str(spec) == "pg":
        from posfreq.train.data.essays import pg_essays

        return Haystack.from_text("pg", "\n\n".join(doc.text for doc in pg_essays()))
    if str(spec) == "noise":
        return Haystack.from_text("noise", NOISE)
    path = Path(spec)
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise FileNotFoundError(
            f"haystack {str(spec)!r}: not 'pg', 'noise', a text file or a directory of .txt files"
        )
    return Haystack.from_text(str(path), "\n\n".join(f.read_text(encoding="utf-8") for f in files))


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt is framed around the NIAH text: the answer budget, BOS, and a chat turn.

    `chat_prefix` / `chat_suffix` are the token ids a chat template puts before and after the
    user's message (empty without a template); with a template the BOS is whatever the template
    renders, so `bos` should be False (the probe's `--bos auto` does that).
    """

    answer_budget: int = ANSWER_BUDGET
    bos: bool = True
    chat_prefix: tuple[int, ...] = ()
    chat_suffix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.answer_budget < 1:
            raise ValueError(f"answer_budget must be >= 1, got {self.answer_budget}")

    @property
    def chat(self) -> bool:
        return bool(self.chat_prefix or self.chat_suffix)


@dataclass(frozen=True, eq=False)
class NiahTest:
    """One NIAH test of `length` tokens: the prompt ids (length - answer_budget), its needles and where they sit."""

    length: int
    answer_budget: int
    seed: int
    index: int
    tokenizer: str
    haystack: str
    haystack_sha256: str
    input_ids: np.ndarray
    prompt: str
    needles: tuple[str, ...]
    positions: tuple[int, ...]
    depths: tuple[float, ...]
    sentence_index: tuple[int, ...]
    n_sentences: int
    question_position: int
    prompt_sha256: str

    @property
    def prompt_length(self) -> int:
        return len(self.input_ids)

    @property
    def distances(self) -> tuple[int, ...]:
        """Each needle's distance in tokens from its first token to the question's first token."""
        return tuple(self.question_position - p for p in self.positions)

    def record(self) -> dict:
        """The test's metadata as a JSON-ready dict (no ids, no prompt text)."""
        return {
            "length": self.length,
            "prompt_length": self.prompt_length,
            "answer_budget": self.answer_budget,
            "seed": self.seed,
            "index": self.index,
            "tokenizer": self.tokenizer,
            "haystack": self.haystack,
            "haystack_sha256": self.haystack_sha256,
            "prompt_sha256": self.prompt_sha256,
            "needles": list(self.needles),
            "positions": list(self.positions),
            "depths": list(self.depths),
            "distances": list(self.distances),
            "question_position": self.question_position,
        }


class NiahBuilder:
    """Builds NIAH tests for one tokenizer, haystack and prompt format, tokenizing the haystack once."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        haystack: str | Path | Haystack = "pg",
        prompt_format: PromptFormat = PromptFormat(),
    ) -> None:
        self.tokenizer = tokenizer
        self.format = prompt_format
        self.haystack = haystack if isinstance(haystack, Haystack) else load_haystack(haystack)
        self._sentences = [
            np.asarray(tokenizer.encode(" " + s), dtype=np.int64) for s in self.haystack.sentences
        ]
        self._lengths = np.array([len(p) for p in self._sentences], dtype=np.int64)
        encode = lambda text: np.asarray(tokenizer.encode(text), dtype=np.int64)  # noqa: E731
        head = [np.asarray(prompt_format.chat_prefix, dtype=np.int64), encode(_HEAD)]
        if prompt_format.bos:
            if tokenizer.bos_id is None:
                raise ValueError(  # the probe refuses this earlier, naming its options (sources.py)
                    f"PromptFormat(bos=True) but tokenizer {tokenizer.name} has no BOS token to start the "
                    "prompt with. Fix: PromptFormat(bos=False), or the tokenizer the model trained with"
                )
            head.insert(0, np.array([tokenizer.bos_id], dtype=np.int64))
        self._head = np.concatenate(head)
        if prompt_format.chat:
            tail = [
                encode(_QUESTION),
                np.asarray(prompt_format.chat_suffix, dtype=np.int64),
                encode(ANSWER_PREFIX),
            ]
            self._tail = np.concatenate(tail)
        else:
            self._tail = encode(_TAIL)
        self._space = tokenizer.encode(" ")

    @property
    def digest(self) -> str:
        """sha256 of everything a prompt is made of except the test's own draws: haystack, frame, tokenizer."""
        blob = json.dumps(
            {
                "haystack": self.haystack.sha256,
                "tokenizer": self.tokenizer.fingerprint,
                "head": self._head.tolist(),
                "tail": self._tail.tolist(),
                "answer_budget": self.format.answer_budget,
            }
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def min_length(self) -> int:
        """The shortest test length this builder can make: frame, 4 needles of the longest kind, answer budget."""
        longest_needle = len(self.tokenizer.encode(" " + NEEDLE.format("999999")))
        return (
            len(self._head)
            + len(self._tail)
            + N_NEEDLES * longest_needle
            + self.format.answer_budget
        )

    def make_tests(self, length: int, n_tests: int, seed: int = 0) -> list[NiahTest]:
        """Tests 0..n_tests-1 of one length; test i depends only on (seed, length, i)."""
        return [self.build(length, seed, index) for index in range(n_tests)]

    def build(self, length: int, seed: int, index: int) -> NiahTest:
        """One test, drawn from numpy's default_rng seeded with (seed, length, index)."""
        if min(length, seed, index) < 0:
            raise ValueError(f"length, seed and index must be >= 0, got {length}, {seed}, {index}")
        rng = test_rng(length, seed, index)
        numbers = draw_needle_numbers(rng)
        needles = [
            np.asarray(self.tokenizer.encode(" " + NEEDLE.format(n)), dtype=np.int64)
            for n in numbers
        ]
        prompt_length = length - self.format.answer_budget
        fixed = len(self._head) + len(self._tail) + sum(len(n) for n in needles)
        if fixed > prompt_length:
            raise ValueError(
                f"NIAH length {length} is too short for tokenizer {self.tokenizer.name!r}: the frame "
                f"(BOS/chat turn, instruction, question) and {N_NEEDLES} needles take {fixed} tokens and the "
                f"answer budget {self.format.answer_budget}. Fix: ask for a length of at least "
                f"{self.min_length()} or a smaller answer budget."
            )
        sentences = self._fill(prompt_length - fixed)
        depth_draws = (np.arange(N_NEEDLES) + rng.random(N_NEEDLES)) / N_NEEDLES
        where = [int(d * len(sentences)) for d in depth_draws]

        segments = [self._head]
        positions: list[int] = []
        cursor = len(self._head)
        for k in range(len(sentences) + 1):
            for j in (j for j in range(N_NEEDLES) if where[j] == k):
                positions.append(cursor)
                segments.append(needles[j])
                cursor += len(needles[j])
            if k < len(sentences):
                segments.append(sentences[k])
                cursor += len(sentences[k])
        segments.append(self._tail)
        ids = np.concatenate(segments)
        if len(ids) != prompt_length:
            raise AssertionError(
                f"built {len(ids)} tokens for prompt length {prompt_length}: a bug in NiahBuilder"
            )
        prompt = self.tokenizer.decode(
            ids[int(self.format.bos) :].tolist()
        )  # the text, without BOS
        for number in numbers:
            if prompt.count(number) != 1:
                raise AssertionError(
                    f"needle {number} occurs {prompt.count(number)} times in test {index} (length "
                    f"{length}, seed {seed}); the haystack must be digit-free"
                )
        return NiahTest(
            length=length,
            answer_budget=self.format.answer_budget,
            seed=seed,
            index=index,
            tokenizer=self.tokenizer.name,
            haystack=self.haystack.name,
            haystack_sha256=self.haystack.sha256,
            input_ids=ids,
            prompt=prompt,
            needles=tuple(numbers),
            positions=tuple(positions),
            depths=tuple(p / prompt_length for p in positions),
            sentence_index=tuple(where),
            n_sentences=len(sentences),
            question_position=cursor,
            prompt_sha256=hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest(),
        )

    def _fill(self, budget: int) -> list[np.ndarray]:
        """Haystack sentences from the start (cycled) of exactly `budget` tokens, the last one cut."""
        n = len(self._lengths)
        reps = budget // int(self._lengths.sum()) + 1
        cumulative = np.cumsum(np.tile(self._lengths, reps))
        whole = int(np.searchsorted(cumulative, budget, side="right"))
        sentences = [self._sentences[i % n] for i in range(whole)]
        rest = budget - (int(cumulative[whole - 1]) if whole else 0)
        if rest:
            sentences.append(self._cut(self._sentences[whole % n], rest))
        return sentences

    def _cut(self, sentence: np.ndarray, size: int) -> np.ndarray:
        """`size` tokens: the longest prefix of `sentence` ending on a whole character, padded with spaces."""
        decode = self.tokenizer.decode
        keep = next(k for k in range(size, -1, -1) if "\ufffd" not in decode(sentence[:k].tolist()))
        if keep == size:
            return sentence[:size]
        if len(self._space) != 1:
            raise ValueError(
                f"tokenizer {self.tokenizer.name!r}: cannot end the haystack on an exact token count: "
                f"cutting a sentence at {size} tokens splits a character and ' ' is not one token"
            )
        return np.concatenate(
            [sentence[:keep], np.full(size - keep, self._space[0], dtype=np.int64)]
        )


def test_rng(length: int, seed: int, index: int) -> np.random.Generator:
    """The random stream of one test: numpy's default_rng seeded with (seed, length, index)."""
    return np.random.default_rng([seed, length, index])


def draw_needle_numbers(rng: np.random.Generator) -> list[str]:
    """Four distinct 6-digit needle numbers: the first draw from a test's stream."""
    return [str(n) for n in rng.choice(900_000, size=N_NEEDLES, replace=False) + 100_000]


def probe_needles(lengths: Sequence[int], n_tests: int, seed: int) -> set[str]:
    """Every needle number the tests (lengths x n_tests, seed) will use, without building prompts.

    Training corpora pass these to their generator as numbers to avoid, so no probe needle is
    ever a training needle.
    """
    return {
        n
        for length in lengths
        for index in range(n_tests)
        for n in draw_needle_numbers(test_rng(length, seed, index))
    }


def make_tests(
    tokenizer: Tokenizer,
    length: int,
    n_tests: int,
    seed: int = 0,
    haystack: str | Path | Haystack = "pg",
    prompt_format: PromptFormat = PromptFormat(),
) -> list[NiahTest]:
    """`n_tests` NIAH tests of exactly `length` tokens (prompt + answer budget), the same for a seed on any machine."""
    return NiahBuilder(tokenizer, haystack, prompt_format).make_tests(length, n_tests, seed)


def answer_text(numbers: Sequence[str]) -> str:
    """The reference answer after ANSWER_PREFIX: " A, B, C and D." (the order given); one number alone: " A."."""
    if len(numbers) == 1:
        return f" {numbers[0]}."
    return " " + ", ".join(numbers[:-1]) + " and " + numbers[-1] + "."
