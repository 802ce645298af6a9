"""RulerSettings: the one definition of `posfreq ruler`'s flags, and what it refuses before anything loads."""

from __future__ import annotations

from dataclasses import fields

import pytest

from posfreq.analysis.ruler_task.settings import RulerSettings
from posfreq.scripts.commands import ruler


def test_the_command_has_a_flag_for_every_setting_and_no_other() -> None:
    flags = {a.dest for a in ruler.build_parser()._actions} - {"help", "print_config"}
    assert flags == {f.name for f in fields(RulerSettings)}
    args = ruler.parse(
        ruler.build_parser(), ["--model", "hf:x", "--shift", "100", "--samples", "3"]
    )
    assert (args.shift, args.samples, args.positions, args.tasks) == (100, 3, "rope", "all")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"samples": 0}, "--samples 0: each task needs at least one sample"),
        ({"positions": "alibi"}, "alibi"),
    ],
)
def test_a_setting_that_cannot_run_is_refused_with_its_fix(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RulerSettings(model="hf:x", **changes)


def test_a_refused_setting_is_a_usage_error_of_the_command(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        ruler.main(["--model", "hf:x", "--samples", "0"])
    assert stop.value.code == 2 and "Fix: --samples 500" in capsys.readouterr().err
