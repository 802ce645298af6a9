"""The bounded Jinja sandbox, in this process: no template operation builds a huge value, and ordinary templates
render as Hugging Face's Jinja would."""

from __future__ import annotations

import pytest

from posfreq.train.data.chat_template.sandbox import render_here

GROWING = [
    ("{{ '%100000000d' % 1 }}", "%-format with a width"),
    ("{{ '%*d' % (100000000, 1) }}", "width given at run time"),
    ("{{ 'x'.center(100000000) }}", "str.center"),
    ("{{ 'x'.ljust(100000000) }}", "str.ljust"),
    ("{{ '{:>100000000}'.format(1) }}", "str.format with a width"),
    ("{{ 'x' | center(100000000) }}", "center"),
    ("{{ 'a\nb' | indent(100000000) }}", "indent"),
    ("{{ '%100000000s' | format('x') }}", "format with a width"),
    ("{{ range(100000) | join('x' * 999) }}", "a join"),
    ("{{ ('x' * 999999).replace('x', 'yy') }}", "str.replace"),
    (
        "{% set ns = namespace(s='x' * 999) %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "`~`",
    ),
    (
        "{% set ns = namespace(s='x' * 999) %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "`+`",
    ),
    ("{{ [1] | batch(100000000, 0) | list }}", "batch"),
]


@pytest.mark.parametrize("template,message", GROWING, ids=[t for t, _ in GROWING])
def test_no_template_operation_builds_a_huge_value(template, message):
    """'%100000000d' % 1, center, ljust, format, indent, join and `~` in a loop each built 100-512 MB in under 2 s:
    the sandbox refuses each before it runs, in one error, with little memory used in this process (no worker
    and its hard limits here: the sandbox's own checks)."""
    import time
    import tracemalloc

    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match=message.replace("`", ".").replace("(", r"\(")):
            render_here(template, [{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 2 and peak < 50 * 2**20, peak


def test_ordinary_templates_still_render_in_the_bounded_sandbox():
    template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' ~ m['role'] ~ '|>\\n' + m['content'] | trim }}"
        "{{ '%s' % eos_token }}{% endfor %}{{ '{:>3}'.format(7) }}{{ ['a', 'b'] | join(', ') }}"
        "{{ 'x' | center(5) }}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    text = render_here(
        template, [{"role": "user", "content": " hi "}], bos_token="<s>", eos_token="</s>"
    )
    assert text == "<s><|user|>\nhi</s>  7a, b  x  <|assistant|>"
