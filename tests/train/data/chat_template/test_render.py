"""Chat templates rendered in a child process under hard limits: a template that would take the machine is one
error naming its file, and the parent's memory is untouched."""

from __future__ import annotations

import pytest

from posfreq.train.data.chat_template import render
from posfreq.train.data.chat_template.render import render_chat_template

HOSTILE = [
    # quadratic copying in C (sum over lists; 50 s and 2 GB before): stopped by the alarm or one of the child's hard
    # limits (its memory, or its CPU time, whichever it reaches first on the machine)
    (
        "{% set a = [0]*1000000 %}{% set n = ([a]*130)|sum(start=[])|length %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "within 2 s|its CPU time limit|its 256 MiB memory limit",
    ),
    # a width behind a mapping key, in %-format and in the format filter: refused before it runs
    ("{{ '%(a)2000000000s' % {'a': 'x'} }}", "a %-format with a width"),
    ("{{ '%(a)2000000000s' | format(a='x') }}", "format with a width"),
    # copies of a million-item list, each step small: stopped by the child's memory limit (256 MiB here, to reach
    # it before the alarm on a slow machine), not by the alarm
    ("{% set a = [0]*1000000 %}{{ ([a]*1000)|map('list')|list|length }}", "256 MiB memory limit"),
]


@pytest.mark.parametrize(
    "template,message", HOSTILE, ids=["sum", "mapping width", "format kwargs", "map list"]
)
def test_a_template_cannot_take_the_machine(template, message, monkeypatch):
    """The third review's templates: one ran past 50 s and 2 GB, one allocated 2.2 GB against a 1,000,000-character
    limit, one reached 2.7 GB. The worker's hard limits (address space, CPU time) or the sandbox's checks stop each
    in one ValueError naming the template's file and the limit, within seconds, with the parent's memory untouched;
    the next render starts a fresh worker."""
    import resource
    import time

    monkeypatch.setattr(render, "MEMORY_BYTES", 256 << 20)
    render._stop()  # a worker started now takes the limit above
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(ValueError, match=message) as refused:
        render_chat_template(
            template, [{"role": "user", "content": "hi"}], source="M/chat_template.jinja"
        )
    assert str(refused.value).startswith("M/chat_template.jinja: ") and "Fix: " in str(
        refused.value
    )
    assert time.monotonic() - started < 8
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024
    )  # KiB: not in this process
    assert (
        render_chat_template("{{ messages[0]['content'] }}", [{"role": "user", "content": "ok"}])
        == "ok"
    )
