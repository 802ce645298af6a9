"""What `posfreq compare` reads of a probed run besides its table: the run's metrics.jsonl, found where the run's
checkpoints are (the folder holding the probe, else the recorded path), with a torn last line left out."""

from __future__ import annotations

import json

import pytest
from helpers.probe import make_fake_run, probe_fake_run

from posfreq.analysis.verdicts.probed_runs import run_metrics


def test_the_runs_metrics_are_read_beside_its_checkpoints(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60, 81_920: 110})
    probe_fake_run(run, out, names, [160, 512], [], monkeypatch)
    assert run_metrics(out) == []  # no metrics.jsonl: no curve, no error
    rows = [{"step": 1, "tokens": 512, "loss": 5.0}, {"step": 2, "tokens": 1024, "val_loss": 4.0}]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo'
    )
    assert run_metrics(out) == rows


@pytest.mark.slow
def test_milestones_loss_by_distance_is_read_and_drawn_against_f(tmp_path, monkeypatch):
    import numpy as np

    from posfreq.analysis.verdicts.compare import draw_loss_figures
    from posfreq.analysis.verdicts.probed_runs import run_loss_by_distance
    from posfreq.train.checkpoint.layout import LOSS_BY_DISTANCE_FILE, checkpoint_root
    from posfreq.train.run.loss_by_distance import LossByDistance

    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60, 81_920: 110})
    probe_fake_run(run, out, names, [160, 512], [], monkeypatch)
    assert run_loss_by_distance(out) == []
    config = {"seed": 0, "data": {"packing": "concat"}}
    for name in names:
        (checkpoint_root(run) / name / "config.json").write_text(json.dumps(config))
    stored = {}
    for i, name in enumerate(sorted(names)):  # as the trainer's validation stores it in a milestone
        table = LossByDistance.empty(511)
        table.tokens[:] = 10
        table.loss_sum[:] = 10 * (5.0 - i)
        stored[name] = table
        (checkpoint_root(run) / name / LOSS_BY_DISTANCE_FILE).write_text(
            json.dumps(table.to_dict())
        )
    found = run_loss_by_distance(out)
    assert [tokens for tokens, _, _ in found] == [40_960, 81_920]
    assert np.allclose(found[-1][1].mean(), 4.0) and found[-1][2].sum() > 0
    identity = {out: (512, 0, "concat")}
    draw_loss_figures(
        {out: out}, identity, {(512, 0, "concat"): found}, "concat", tmp_path / "figures"
    )
    drawn = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    assert drawn == ["loss_by_distance_L512-s0.png", "loss_vs_frequency.png"]
