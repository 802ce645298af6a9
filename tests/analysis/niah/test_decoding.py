"""Decoding and scoring: the teacher-forced score against a naive per-token computation."""

from __future__ import annotations

import pytest
import torch
from helpers.probe import tiny_model

from posfreq.analysis.niah import decoding as probe_decoding
from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah.needles import NiahBuilder, PromptFormat, answer_text
from posfreq.train.data.tokenizer import get_tokenizer


def naive_scores(model, test, ids: list[int], a: int, b: int) -> tuple[float, float]:
    """The summed log-probability and token accuracy of ids[a:b] after the test's prompt and ids[:a]: one plain
    forward of the prompt and the whole answer, no cache, no batching (a causal model's logits for ids[t] read
    nothing after it), in float64 sums."""
    prompt = test.input_ids.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids]))[0, len(prompt) - 1 + a : len(prompt) - 1 + b]
    target = torch.tensor(ids[a:b])
    logprob = logits.double().log_softmax(-1)[torch.arange(b - a), target].sum()
    return float(logprob), float((logits.argmax(-1) == target).double().mean())


@pytest.mark.parametrize("positions", ["rope", "string"])
def test_teacher_forced_score_equals_a_plain_uncached_forward(positions):
    """Every answer order against the naive computation: the named orders score the reference answer in one
    forward; `alone` takes each needle as the whole answer (" 123456.") on the prompt's cache and scores its digits
    after its cue, the fewest no other needle starts with, so no needle is conditioned on another (STRING's shift
    S = 128 < the prompt: the cached continuation crosses it)."""
    model = tiny_model(seed=3)
    if positions == "string":
        model.set_positions("string", shift=128)
    tok = get_tokenizer("bytes")
    builder = NiahBuilder(tok, "noise", PromptFormat(answer_budget=40, bos=False))
    # test 1's needles 247484, 246181, 240795: cues of 3 digits
    tests = builder.make_tests(420, 2, seed=13)
    cues = []
    for order in probe_settings.ANSWER_ORDERS:
        scores = probe_decoding.teacher_forced(model, tok, tests, torch.device("cpu"), order=order)
        for test, score in zip(tests, scores):
            assert score["tf_answer_order"] == order
            if order == "alone":
                answers = probe_decoding.needle_answers(tok, test)
                for j, (ids, (a, b)) in enumerate(answers):
                    assert (
                        tok.decode(ids) == answer_text([test.needles[j]]) == f" {test.needles[j]}."
                    )
                    # the cue: the needle's shortest prefix no other needle of the test starts with
                    number = test.needles[j]
                    cue = next(
                        (
                            k
                            for k in range(1, len(number) - 1)
                            if not any(
                                o.startswith(number[:k]) for o in test.needles if o != number
                            )
                        ),
                        len(number) - 1,
                    )
                    assert tok.decode(ids[a:b]) == test.needles[j][cue:]
                    assert tok.decode(ids[:a]) == f" {test.needles[j][:cue]}"
                    cues.append(cue)
                    logprob, accuracy = naive_scores(model, test, ids, a, b)
                    assert score["tf_logprob"][j] == pytest.approx(logprob, rel=1e-4, abs=1e-3)
                    assert score["tf_token_accuracy"][j] == pytest.approx(accuracy)
                continue
            ids, spans = probe_decoding.reference_answer(tok, test, order)
            assert tok.decode(ids) == answer_text(
                sorted(
                    test.needles,
                    key=lambda n: (
                        test.needles.index(n) if order == "document" else -test.needles.index(n)
                    ),
                )
            )
            for j, (a, b) in enumerate(spans):
                assert tok.decode(ids[a:b]) == test.needles[j]
                logprob, accuracy = naive_scores(model, test, ids, a, b)
                assert score["tf_logprob"][j] == pytest.approx(logprob, rel=1e-4, abs=1e-3)
                assert score["tf_token_accuracy"][j] == pytest.approx(accuracy)
    assert max(cues) == 3  # the shared prefixes were cued, not only first digits
    with pytest.raises(ValueError, match="reference answer's order"):
        probe_decoding.reference_answer(tok, tests[0], "alone")


def test_the_cue_is_the_fewest_tokens_no_other_needle_starts_with_and_leaves_one_to_score():
    """By hand: distinct first tokens cue alone; a shared first token needs the second; needles that differ only in
    their last token keep it to score (the one contested token); a one-token needle leaves nothing."""
    assert probe_decoding.cue_lengths([[1, 2, 3], [4, 5, 6]]) == [1, 1]
    assert probe_decoding.cue_lengths([[1, 2, 3], [1, 5, 6], [7, 8, 9]]) == [2, 2, 1]
    assert probe_decoding.cue_lengths([[1, 2, 3], [1, 2, 4]]) == [2, 2]
    assert probe_decoding.cue_lengths([[1, 2], [1, 3]]) == [1, 1]
    # lengths differ: [1, 2] is a prefix of the first, so it cues 3; [5] leaves nothing to score
    assert probe_decoding.cue_lengths([[1, 2, 3, 4], [1, 2], [5]]) == [3, 1, 1]


def test_order_free_scores_need_needles_of_more_than_one_token():
    """A tokenizer that makes a needle one token leaves nothing after the cue: refused, naming the needle and the
    fix, as a ProbeError (the probe's commands print it as one line)."""

    class OneToken:
        eos_id = 0

        def encode(self, text: str) -> list[int]:
            return [int(text)] if text.isdigit() else [ord(c) for c in text]

    tok = get_tokenizer("bytes")
    test = NiahBuilder(tok, "noise", PromptFormat(answer_budget=40, bos=False)).make_tests(
        420, 1, seed=5
    )[0]
    with pytest.raises(
        probe_settings.ProbeError, match=f"needle {test.needles[0]} is one token.*order document"
    ):
        probe_decoding.teacher_forced(
            tiny_model(seed=3), OneToken(), [test], torch.device("cpu"), order="alone"
        )


def test_every_engine_takes_the_one_generator_protocol_as_declared():
    """One Generator protocol: posfreq's Transformer and the transformers engine take its methods' parameters,
    by name and order, so a change to the protocol that an engine misses fails here."""
    import inspect

    from posfreq.analysis.niah.decoding import Generator
    from posfreq.analysis.niah.hf_engine import TransformersGenerator
    from posfreq.train.model.transformer import Transformer

    for method in ("generate", "target_logprobs", "continuation_logprobs"):
        declared = list(inspect.signature(getattr(Generator, method)).parameters)
        for engine in (Transformer, TransformersGenerator):
            assert list(inspect.signature(getattr(engine, method)).parameters) == declared, (
                engine,
                method,
            )
    assert Generator in TransformersGenerator.__mro__
