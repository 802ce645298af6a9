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
    forward; `alone` scores each needle as the whole answer (" 123456.") on the prompt's cache, so a needle's score
    does not depend on the others (STRING's shift S = 128 < the prompt: the cached continuation crosses it)."""
    model = tiny_model(seed=3)
    if positions == "string":
        model.set_positions("string", shift=128)
    tok = get_tokenizer("bytes")
    builder = NiahBuilder(tok, "noise", PromptFormat(answer_budget=40, bos=False))
    tests = builder.make_tests(420, 2, seed=5)
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
                    assert tok.decode(ids[a:b]) == test.needles[j]
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
    with pytest.raises(ValueError, match="reference answer's order"):
        probe_decoding.reference_answer(tok, tests[0], "alone")


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
