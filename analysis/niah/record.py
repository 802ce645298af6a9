"""The type of one probe record, a line of a result directory's tests/L*.jsonl (analysis/niah/store.py reads and
checks them): declared once, so the writer, the checks and every reader agree on its fields."""

from typing import Required, TypedDict  # no `from __future__ import annotations`: it hides Required


class ProbeRecord(TypedDict, total=False):
    """One test's line of tests/L*.jsonl as the probe writes it (analysis/niah/decoding.score_tests) and
    `checked_records` returns it: the test, its decoded answer and scores when it decoded, its teacher-forced
    scores when it measured them. Lists hold one entry per needle."""

    key: Required[str]
    length: Required[int]
    prompt_length: Required[int]
    answer_budget: Required[int]
    seed: Required[int]
    index: Required[int]
    tokenizer: Required[str]
    haystack: Required[str]
    haystack_sha256: Required[str]
    prompt_sha256: Required[str]
    needles: Required[list[str]]
    positions: Required[list[int]]
    depths: Required[list[float]]
    distances: Required[list[int]]
    question_position: Required[int]
    hits_anywhere: list[bool]
    """Greedy decoding only, as are the next four."""
    hits_first_line: list[bool]
    answer: str
    numbers: list[str]
    generated: str
    tf_logprob: list[float]
    """Teacher-forced scoring only, as are the next two."""
    tf_token_accuracy: list[float]
    tf_answer_order: str
