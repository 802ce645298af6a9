"""Decoding and scoring of NIAH tests: greedy answers with the KV cache, the teacher-forced needle score,
and the per-test records."""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from posfreq.analysis.niah.needles import ANSWER_BUDGET, NiahTest, answer_text
from posfreq.analysis.niah.scoring import all_needles_in, score_answer
from posfreq.analysis.niah.settings import ANSWER_ORDERS, ProbeError
from posfreq.train.data.tokenizer import Tokenizer


class Generator(Protocol):
    """What the probe needs of a model (train.model.transformer.Transformer): greedy decoding and teacher forcing."""

    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        stop: Callable[[int, list[int]], bool] | None = None,
        prefill_dtype: torch.dtype | None = None,
        prefill_tokens: int | None = None,
    ) -> list[list[int]]: ...

    def target_logprobs(
        self, input_ids: torch.Tensor, first_target: int, prefill_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def continuation_logprobs(
        self,
        prompt_ids: torch.Tensor,
        continuations: Sequence[torch.Tensor],
        prefill_tokens: int | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def autocast(
    precision: str, device: torch.device, prefill: bool = False
) -> contextlib.AbstractContextManager:
    """bf16 autocast for `bfloat16`, and for `bfloat16-prefill` around a prefill-only pass (weights stay float32);
    nothing otherwise."""
    if precision == "bfloat16" or (prefill and precision == "bfloat16-prefill"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cut_at_eos(tokens: Sequence[int], eos_id: int) -> list[int]:
    """The generated ids before the first EOS."""
    tokens = list(tokens)
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def generate_answers(
    model: Generator,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    device: torch.device,
    precision: str = "float32",
    max_new_tokens: int = ANSWER_BUDGET,
    prefill_tokens: int | None = None,
) -> list[str]:
    """Greedy answers (decoded, cut at EOS) to equal-length tests, decoded together.

    A row stops at EOS or once all four of its needles appeared (its score can no longer change).
    The prompts' forward takes at most `prefill_tokens` tokens at a time (None: all at once).
    """
    if len({t.prompt_length for t in tests}) > 1:
        raise ValueError(
            "generate_answers needs prompts of one length (a batch must be rectangular)"
        )

    def stop(row: int, tokens: list[int]) -> bool:
        return tokens[-1] == tokenizer.eos_id or all_needles_in(
            tests[row].needles, tokenizer.decode(tokens)
        )

    prompt = torch.from_numpy(np.stack([t.input_ids for t in tests])).to(device)
    prefill_dtype = torch.bfloat16 if precision == "bfloat16-prefill" else None
    with torch.inference_mode(), autocast(precision, device):
        generated = model.generate(
            prompt,
            max_new_tokens,
            stop=stop,
            prefill_dtype=prefill_dtype,
            prefill_tokens=prefill_tokens,
        )
    return [tokenizer.decode(cut_at_eos(g, tokenizer.eos_id)) for g in generated]


def reference_answer(
    tokenizer: Tokenizer, test: NiahTest, order: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the reference answer (`niah.answer_text`) and each needle's token span in it, by test needle.

    Tokenized piece by piece (separators and numbers apart), so each needle's tokens are exact;
    the pieces decode to the answer text. Order `alone` has one answer per needle (`needle_answers`).
    """
    if order not in ANSWER_ORDERS or order == "alone":
        raise ValueError(
            f"a reference answer's order must be one of {[o for o in ANSWER_ORDERS if o != 'alone']}, "
            f"got {order!r}"
        )
    ranked = (
        sorted(range(len(test.needles)), key=lambda j: -test.positions[j])
        if order == "nearest_first"
        else list(range(len(test.needles)))
    )
    return _answer_ids(tokenizer, [test.needles[j] for j in ranked], ranked)


def _answer_ids(
    tokenizer: Tokenizer, numbers: Sequence[str], needles: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The answer naming `numbers` (test needles `needles`, in that order) as token ids, and each named needle's
    span, by needle: tokenized piece by piece, so each needle's tokens are exact."""
    text = answer_text(list(numbers))
    ids: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    cursor = 0
    for j, number in zip(needles, numbers):
        at = text.index(number, cursor)
        ids += tokenizer.encode(text[cursor:at])
        piece = tokenizer.encode(number)
        spans[j] = (len(ids), len(ids) + len(piece))
        ids += piece
        cursor = at + len(number)
    ids += tokenizer.encode(text[cursor:])
    return ids, [spans[j] for j in sorted(spans)]


def needle_answers(tokenizer: Tokenizer, test: NiahTest) -> list[tuple[list[int], tuple[int, int]]]:
    """Per needle: the answer that names it alone (" A.") as token ids, and the span scored in it: the needle's
    tokens after its cue (`cue_lengths`)."""
    answers = [_answer_ids(tokenizer, [number], [j]) for j, number in enumerate(test.needles)]
    needles = [ids[a:b] for ids, ((a, b),) in answers]
    return [(ids, (a + cue, b)) for (ids, ((a, b),)), cue in zip(answers, cue_lengths(needles))]


def cue_lengths(needles: Sequence[Sequence[int]]) -> list[int]:
    """Per needle (its token ids): how many of its first tokens cue it, the fewest that no other needle starts
    with, at most all but its last. Four needles compete for the answer's first tokens (which one the model names
    first), so the order-free score teacher-forces this cue and scores the tokens after it: only where two needles
    differ in their last token alone is that token still contested."""
    cues = []
    for j, ids in enumerate(needles):
        others = [other for k, other in enumerate(needles) if k != j]
        cue = 1
        while cue < len(ids) - 1 and any(list(o[:cue]) == list(ids[:cue]) for o in others):
            cue += 1
        cues.append(cue)
    return cues


def uncued_needle(
    test: NiahTest, answers: Sequence[tuple[list[int], tuple[int, int]]]
) -> str | None:
    """Why `test` cannot be scored order-free (a needle of one token leaves none after its cue), or None."""
    for number, (_, (a, b)) in zip(test.needles, answers):
        if a >= b:
            return (
                f"--answer-order alone scores each needle's tokens after its cue, but needle {number} is one "
                "token under this tokenizer, which leaves none. Fix: use --answer-order document or nearest_first"
            )
    return None


def longest_answer(tokenizer: Tokenizer, test: NiahTest, order: str) -> int:
    """The most tokens a teacher-forced answer of `test` takes under `order` (the budget must hold it)."""
    if order == "alone":
        return max(len(ids) for ids, _ in needle_answers(tokenizer, test))
    return len(reference_answer(tokenizer, test, order)[0])


def teacher_forced(
    model: Generator,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    device: torch.device,
    precision: str = "float32",
    order: str = "document",
    prefill_tokens: int | None = None,
) -> list[dict]:
    """Per test: each needle's summed log-probability and token accuracy under teacher forcing.

    In a named order: the reference answer follows the prompt, right-padded to the batch's longest, in one
    forward pass; causal attention keeps the padding out of every scored position, and prompt + answer stays
    within the test length. Alone: each needle's own answer is scored on the prompt's KV cache (`needle_answers`,
    `Generator.continuation_logprobs`), on its tokens after its cue, so no needle is conditioned on another and
    none competes with another for the first tokens. A forward takes at most
    `prefill_tokens` tokens (None: the whole batch).
    """
    for test in tests:
        length = longest_answer(tokenizer, test, order)
        if length > test.answer_budget:
            raise ValueError(
                f"the reference answer takes {length} tokens, more than the answer budget "
                f"{test.answer_budget}. Fix: raise --max-new-tokens to at least {length}"
            )
    if order == "alone":
        return _alone(model, tokenizer, tests, device, precision, prefill_tokens)
    answers = [reference_answer(tokenizer, t, order) for t in tests]
    prompt_length = tests[0].prompt_length
    width = max(len(ids) for ids, _ in answers)
    batch = np.full((len(tests), prompt_length + width), tokenizer.eos_id, dtype=np.int64)
    for row, (test, (ids, _)) in enumerate(zip(tests, answers)):
        batch[row, :prompt_length] = test.input_ids
        batch[row, prompt_length : prompt_length + len(ids)] = ids
    with torch.inference_mode(), autocast(precision, device, prefill=True):
        logprobs, correct = model.target_logprobs(
            torch.from_numpy(batch).to(device), prompt_length, prefill_tokens
        )
    logprobs, correct = logprobs.float().cpu().numpy(), correct.cpu().numpy()
    return [
        _needle_scores([(logprobs[row], correct[row], a, b) for a, b in spans], order)
        for row, (_, spans) in enumerate(answers)
    ]


def _alone(
    model: Generator,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    device: torch.device,
    precision: str,
    prefill_tokens: int | None,
) -> list[dict]:
    """The order-free score: needle j of every test as the whole answer after the prompt, prefilled once, scored on
    its tokens after its cue (`needle_answers`)."""
    answers = [needle_answers(tokenizer, t) for t in tests]
    for test, test_answers in zip(tests, answers):
        # the probe refuses its first test's before the model runs (check_model); this guards every test
        if problem := uncued_needle(test, test_answers):
            raise ProbeError(problem)
    continuations = []
    for j in range(len(tests[0].needles)):
        width = max(len(a[j][0]) for a in answers)
        rows = np.full((len(tests), width), tokenizer.eos_id, dtype=np.int64)
        for row, a in enumerate(answers):
            rows[row, : len(a[j][0])] = a[j][0]
        continuations.append(torch.from_numpy(rows).to(device))
    prompt = torch.from_numpy(np.stack([t.input_ids for t in tests])).to(device)
    with torch.inference_mode(), autocast(precision, device, prefill=True):
        scored = model.continuation_logprobs(prompt, continuations, prefill_tokens)
    scored = [(lp.float().cpu().numpy(), hit.cpu().numpy()) for lp, hit in scored]
    return [
        _needle_scores(
            [(scored[j][0][row], scored[j][1][row], *a[j][1]) for j in range(len(a))], "alone"
        )
        for row, a in enumerate(answers)
    ]


def _needle_scores(spans: Sequence[tuple[np.ndarray, np.ndarray, int, int]], order: str) -> dict:
    """A test's teacher-forced record from each needle's (log-probabilities, argmax hits, span start, span end)."""
    return {
        "tf_logprob": [float(lp[a:b].sum()) for lp, _, a, b in spans],
        "tf_token_accuracy": [float(hit[a:b].mean()) for _, hit, a, b in spans],
        "tf_answer_order": order,
    }


def score_tests(
    tests: Sequence[NiahTest],
    answers: Sequence[str] | None,
    tf: Sequence[dict] | None,
    key: str,
) -> list[dict]:
    """Per-test JSONL records: test metadata, the generated text and both its scores (answers None: not decoded),
    the teacher-forced score, the key."""
    records = []
    for i, test in enumerate(tests):
        record = {**test.record(), "key": key}
        if answers is not None:
            record |= {**score_answer(test, answers[i]).record(), "generated": answers[i]}
        records.append({**record, **(tf[i] if tf is not None else {})})
    return records
