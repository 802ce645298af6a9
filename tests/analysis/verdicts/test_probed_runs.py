"""What `posfreq compare` reads of a probed run besides its table: the run's metrics.jsonl, found where the run's
checkpoints are (the folder holding the probe, else the recorded path), with a torn last line left out."""

from __future__ import annotations

import json

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
