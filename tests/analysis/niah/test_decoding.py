"""Decoding and scoring: the teacher-forced score against a naive per-token computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.probe import tiny_model

from posfreq.analysis.niah import decoding as probe_decoding
from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah.needles import NiahBuilder, PromptFormat, answer_text
from posfreq.train.data.tokenizer import get_tokenizer


def test_teacher_forced_score_equals_a_naive_per_token_computation():
    model = tiny_model(seed=3)
    tok = get_tokenizer("bytes")
    builder = NiahBuilder(tok, "noise", PromptFormat(answer_budget=40, bos=False))
    tests = builder.make_tests(420, 2, seed=5)
    for order in probe_settings.ANSWER_ORDERS:
        scores = probe_decoding.teacher_forced(model, tok, tests, torch.device("cpu"), order=order)
        for test, score in zip(tests, scores):
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
                logprob, correct = 0.0, []
                for t in range(
                    a, b
                ):  # naive: one full forward per answer token, no cache, no batching
                    prefix = torch.tensor([test.input_ids.tolist() + ids[:t]])
                    with torch.no_grad():
                        logits = model(prefix)[0, -1]
                    logprob += float(logits.log_softmax(-1)[ids[t]])
                    correct.append(int(logits.argmax()) == ids[t])
                assert score["tf_logprob"][j] == pytest.approx(logprob, rel=1e-4, abs=1e-3)
                assert score["tf_token_accuracy"][j] == pytest.approx(np.mean(correct))


def test_every_engine_takes_the_one_generator_protocol_as_declared():
    """One Generator protocol: posfreq's Transformer and the transformers engine take its methods' parameters,
    by name and order, so a change to the protocol that an engine misses fails here."""
    import inspect

    from posfreq.analysis.niah.decoding import Generator
    from posfreq.analysis.niah.hf_engine import TransformersGenerator
    from posfreq.train.model.transformer import Transformer

    for method in ("generate", "target_logprobs"):
        declared = list(inspect.signature(getattr(Generator, method)).parameters)
        for engine in (Transformer, TransformersGenerator):
            assert list(inspect.signature(getattr(engine, method)).parameters) == declared, (
                engine,
                method,
            )
    assert Generator in TransformersGenerator.__mro__
