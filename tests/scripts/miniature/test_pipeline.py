"""The demo's stages (scripts/miniature/pipeline.py): a long stage prints a line a minute with its log's latest
line, so `make demo` is never silent; a failed stage names its command and log."""

from __future__ import annotations

import pytest

from posfreq.scripts.miniature import pipeline


@pytest.mark.slow
def test_a_running_stage_reports_itself_and_its_latest_log_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "HEARTBEAT_SECONDS", 0.2)
    p = pipeline.Pipeline(tmp_path / "demo", lanes=1)
    code = "import time\nfor i in range(3):\n    print(f'step {i}', flush=True); time.sleep(0.4)"
    p.run("a stage", "-c", code)
    printed = capsys.readouterr().out
    assert "== a stage: started" in printed and "== a stage: done in" in printed
    beats = [line for line in printed.splitlines() if "a stage: running" in line]
    assert len(beats) >= 2 and any("step" in line for line in beats)
    with pytest.raises(pipeline.DemoError, match=r"stage 'broken' failed \(exit 3\)") as failed:
        p.run("broken", "-c", "raise SystemExit(3)")
    assert str(tmp_path / "demo" / "logs" / "broken.log") in str(failed.value)
