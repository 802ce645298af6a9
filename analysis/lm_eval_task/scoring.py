"""Scores lm-evaluation-harness answers to posfreq's NIAH tests exactly as `scripts/commands/probe.py` scores its own.

lm-eval decodes greedily up to EOS or the answer budget; the probe also stops as soon as all four
needles have appeared (its score can no longer rise). `probe_answer` cuts lm-eval's text where the
probe would have stopped, and `analysis.niah.scoring.score_answer` (the probe's own scoring) scores it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

from posfreq.analysis.niah.scoring import all_needles_in, score_answer


def probe_answer(needles: Sequence[str], text: str) -> str:
    """The prefix of a greedy answer the probe would have decoded: up to where every needle first appears.

    The probe checks after each generated token; a needle can only complete right after a digit,
    so the ends after digits are the candidates. Exact when every digit is its own token (the
    `bytes` tokenizer); with multi-digit tokens a token that glues a digit onto a needle's end
    could make the probe decode on, where this cut stops (see the README).
    """
    for end in range(1, len(text) + 1):
        if text[end - 1].isdigit() and all_needles_in(needles, text[:end]):
            return text[:end]
    return text


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's per-test metrics: the probe's pass (>= min_retrieved needles), needle recall, all four found."""
    answer = probe_answer(doc["needles"], results[0])
    # score_answer reads only these fields of a NiahTest; the JSONL record carries them.
    test = SimpleNamespace(
        prompt=doc["prompt"],
        needles=tuple(doc["needles"]),
        length=doc["length"],
        index=doc["index"],
        depths=tuple(doc["depths"]),
        distances=tuple(doc["distances"]),
    )
    scored = score_answer(test, answer, doc["min_retrieved"], doc["scoring"])
    return {
        "passed": float(scored.passed),
        "needle_recall": scored.retrieved / len(scored.needles),
        "all_needles": float(all(scored.hits)),
    }
