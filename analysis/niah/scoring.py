"""How a NIAH answer scores: the 6-digit numbers it holds, under either rule (anywhere in the
answer, or on its first line), as the per-test record every later table is derived from."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence, get_args

from posfreq.analysis.niah.needles import N_NEEDLES, NiahTest

ScoringRule = Literal["anywhere", "first_line"]
SCORING_RULES: tuple[str, ...] = get_args(ScoringRule)
_NUMBER = re.compile(r"(?<!\d)\d{6}(?!\d)")


def extract_numbers(text: str) -> list[str]:
    """Every run of exactly 6 digits (not part of a longer digit run), in order."""
    return _NUMBER.findall(text)


def _cut_index(text: str) -> int | None:
    """Index of the first newline after the first digit, or None when there is none yet."""
    digit = re.search(r"\d", text)
    if digit is None:
        return None
    newline = text.find("\n", digit.end())
    return None if newline < 0 else newline


def cut_answer(text: str) -> str:
    """The answer up to (not including) the first newline after a digit has appeared."""
    end = _cut_index(text)
    return text if end is None else text[:end]


def all_needles_in(needles: Sequence[str], text: str) -> bool:
    """True once every needle appears in `text` as a whole 6-digit number: no later token can change the score."""
    return set(needles) <= set(extract_numbers(text))


def strip_echo(test: NiahTest, text: str) -> str:
    """The continuation after the prompt when `text` echoes the prompt (e.g. a decoded full sequence)."""
    at = text.find(test.prompt)
    return text if at < 0 else text[at + len(test.prompt) :]


@dataclass(frozen=True)
class NiahResult:
    """The score of one test under both rules; `hits` / `retrieved` / `passed` follow the chosen rule."""

    length: int
    index: int
    rule: str
    needles: tuple[str, ...]
    hits: tuple[bool, ...]
    hits_anywhere: tuple[bool, ...]
    hits_first_line: tuple[bool, ...]
    depths: tuple[float, ...]
    distances: tuple[int, ...]
    answer: str
    numbers: tuple[str, ...]
    retrieved: int
    passed: bool

    def record(self) -> dict:
        """The rule-independent facts as a JSON-ready dict: both hit lists, so any rule can be applied later."""
        return {
            "length": self.length,
            "index": self.index,
            "needles": list(self.needles),
            "hits_anywhere": list(self.hits_anywhere),
            "hits_first_line": list(self.hits_first_line),
            "depths": list(self.depths),
            "distances": list(self.distances),
            "answer": self.answer,
            "numbers": list(self.numbers),
        }


def score_answer(
    test: NiahTest, answer_text: str, min_retrieved: int = 2, rule: str = "anywhere"
) -> NiahResult:
    """Score the generated continuation of `test`'s prompt: pass when >= min_retrieved needles are found."""
    if not 1 <= min_retrieved <= N_NEEDLES:
        raise ValueError(f"min_retrieved must be in 1..{N_NEEDLES}, got {min_retrieved}")
    if rule not in SCORING_RULES:
        raise ValueError(f"unknown scoring rule {rule!r}; choose one of {SCORING_RULES}")
    answer = strip_echo(test, answer_text)
    numbers = tuple(extract_numbers(answer))
    first_line = set(extract_numbers(cut_answer(answer)))
    anywhere = tuple(needle in numbers for needle in test.needles)
    strict = tuple(needle in first_line for needle in test.needles)
    hits = anywhere if rule == "anywhere" else strict
    return NiahResult(
        length=test.length,
        index=test.index,
        rule=rule,
        needles=test.needles,
        hits=hits,
        hits_anywhere=anywhere,
        hits_first_line=strict,
        depths=test.depths,
        distances=test.distances,
        answer=answer,
        numbers=numbers,
        retrieved=sum(hits),
        passed=sum(hits) >= min_retrieved,
    )
