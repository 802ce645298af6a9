"""analysis/niah/record.py: ProbeRecord's fields are exactly those the probe writes, in each of its modes (greedy,
teacher-forced, both), so the type cannot drift from the files."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.probe import FakeSource, job, tiny_model

from posfreq.analysis.niah import runner as probe_runner
from posfreq.analysis.niah import sources as probe_sources
from posfreq.analysis.niah import store
from posfreq.analysis.niah.record import ProbeRecord

GREEDY = {"hits_anywhere", "hits_first_line", "answer", "numbers", "generated"}
TEACHER_FORCED = {"tf_logprob", "tf_token_accuracy", "tf_answer_order"}


@pytest.mark.parametrize(
    "greedy,teacher_forced", [(True, False), (False, True), (True, True)], ids=str
)
def test_every_field_the_probe_writes_is_declared_and_every_required_one_is_written(
    tmp_path, greedy, teacher_forced
):
    base = job([480], tests=2, budget=40)
    settings = dataclasses.replace(base.settings, greedy=greedy, teacher_forced=teacher_forced)
    model = tiny_model()  # a real model: the teacher-forced score reads its log-probabilities
    source = FakeSource(
        "tiny", tmp_path / "m", "hf", "tiny-0", "bytes", 512, 258, False, model=model
    )
    probe_runner.probe_models(
        [source],
        [tmp_path],
        dataclasses.replace(base, settings=settings),
        probe_sources.Builders("noise"),
    )
    record, _ = store.read_records(tmp_path, [480])
    written = set(record)
    assert written <= set(ProbeRecord.__annotations__), written - set(ProbeRecord.__annotations__)
    assert ProbeRecord.__required_keys__ <= written
    optional = written - ProbeRecord.__required_keys__
    assert optional == (GREEDY if greedy else set()) | (TEACHER_FORCED if teacher_forced else set())
