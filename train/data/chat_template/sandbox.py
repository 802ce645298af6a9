"""The in-process half of rendering a chat template (user data): Jinja's immutable sandbox in which no operation
builds a value beyond TEMPLATE_CHARS, an alarm between bytecodes, and an output limit. The child process that runs
it under hard limits is `render`."""

from __future__ import annotations

import functools
import re

TEMPLATE_SECONDS = 2.0
"""Wall-clock limit on rendering a chat template (user data: it may loop for ever)."""
TEMPLATE_CHARS = 1_000_000
"""Output limit on a rendered chat template (one user turn is a few hundred characters)."""


class _TemplateTimeout(Exception):
    pass


_FORMAT_WIDTHS = re.compile(
    r"%(?:\([^()]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?|\{[^{}]*:[^{}]*?(\d+)[^{}]*\}|\{[^{}]*\{"
)
"""Widths and precisions in a %-format or a str.format string (a nested `{` is a width given at run time)."""
_GROWING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "join", "replace"})
"""String methods checked before they run (str.format is checked where jinja wraps it, `wrap_str_format`)."""


def _check_size(size: int, what: str) -> None:
    from jinja2.exceptions import SecurityError

    if size > TEMPLATE_CHARS:
        raise SecurityError(f"{what} of {size:,} items (limit {TEMPLATE_CHARS:,})")


def _check_format(fmt: str, what: str) -> None:
    """Refuse a format string whose widths could build a value beyond TEMPLATE_CHARS (`'%100000000d' % 1`)."""
    for match in _FORMAT_WIDTHS.finditer(fmt):
        numbers = [g for g in match.groups() if g]
        if "*" in numbers or match.group(0).startswith("{") and match.group(0).endswith("{"):
            _check_size(TEMPLATE_CHARS + 1, f"{what} with a width given at run time")
        for number in numbers:
            if number != "*":
                _check_size(int(number), f"{what} with a width")


def _joined(items, separator: str = "") -> list:
    """`items` as a list, refused when joining them would build a value beyond TEMPLATE_CHARS."""
    items = list(items)
    _check_size(sum(len(str(i)) for i in items) + len(separator) * max(len(items) - 1, 0), "a join")
    return items


def _check_growth(obj, name: str, args: tuple, kwargs: dict) -> None:
    """Before a string method that can grow its value runs: its result's size, bounded."""
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check_size(args[0], f"str.{name}")
    elif name == "expandtabs":
        _check_size(
            len(obj) + obj.count("\t") * int(args[0] if args else kwargs.get("tabsize", 8)),
            "expandtabs",
        )
    elif (
        name == "replace"
        and len(args) >= 2
        and isinstance(args[0], str)
        and isinstance(args[1], str)
    ):
        count = obj.count(args[0]) if args[0] else len(obj) + 1
        _check_size(len(obj) + count * max(len(args[1]) - len(args[0]), 0), "str.replace")


def _bounded_filters() -> dict:
    """Jinja's filters that can grow a value, each checked against TEMPLATE_CHARS before it runs."""
    from jinja2 import filters

    def center(value, width=80):
        _check_size(int(width), "center")
        return filters.do_center(value, width)

    def indent(s, width=4, first=False, blank=False):
        _check_size(
            len(str(s))
            + (int(width) if isinstance(width, int) else len(str(width)))
            * (str(s).count("\n") + 1),
            "indent",
        )
        return filters.do_indent(s, width, first, blank)

    def format_(value, *args, **kwargs):
        _check_format(str(value), "format")
        return filters.do_format(value, *args, **kwargs)

    def replace(eval_ctx, s, old, new, count=None):
        _check_growth(str(s), "replace", (str(old), str(new)), {})
        return filters.do_replace(eval_ctx, s, old, new, count)

    def join(eval_ctx, value, d="", attribute=None):
        return filters.do_join(eval_ctx, _joined(value, str(d)), d, attribute)

    def batch(value, linecount, fill_with=None):
        _check_size(int(linecount), "batch")
        return filters.do_batch(value, linecount, fill_with)

    def slice_(value, slices, fill_with=None):
        _check_size(int(slices), "slice")
        return filters.do_slice(value, slices, fill_with)

    def tojson(eval_ctx, value, indent=None):
        if indent is not None:
            _check_size(int(indent) * 1000, "tojson's indent")
        return filters.do_tojson(eval_ctx, value, indent)

    for name, wrapper in (("replace", replace), ("join", join), ("tojson", tojson)):
        wrapper.jinja_pass_arg = getattr(filters, f"do_{name}").jinja_pass_arg  # type: ignore[attr-defined]
    return {
        "center": center,
        "indent": indent,
        "format": format_,
        "replace": replace,
        "join": join,
        "batch": batch,
        "slice": slice_,
        "tojson": tojson,
    }


@functools.cache
def _bounded_sandbox_class():
    """Jinja's immutable sandbox in which no operation can build a value beyond TEMPLATE_CHARS: `*`, `**`, `+`,
    `%`, `~`, the string methods and filters that grow a value are checked before they run. A C-level
    `'a' * 10**8` or `'%100000000d' % 1` runs to its end before any alarm or output check could stop it."""
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedConcat(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # `a ~ b`: through environment.concat_bounded
            self.write("environment.concat_bounded((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedConcat
        intercepted_binops = frozenset(
            {"*", "**", "+", "%"}
        )  # also keeps them out of constant folding

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.filters.update(_bounded_filters())

        def concat_bounded(self, values) -> str:
            values = [str(v) for v in values]
            _check_size(sum(map(len, values)), "a `~` concatenation")
            return "".join(values)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * n, "a repetition")
            elif (
                operator == "+"
                and isinstance(left, (str, list, tuple))
                and isinstance(right, (str, list, tuple))
            ):
                _check_size(len(left) + len(right), "a `+` concatenation")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, "a %-format")
            elif (
                operator == "**"
                and isinstance(left, (int, float))
                and isinstance(right, (int, float))
                and abs(right) > 64
                and abs(left) > 1
            ):
                raise SecurityError("a power beyond 64 (limit)")
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(
            self, value
        ):  # jinja wraps str.format where it is looked up, not where called
            owner = getattr(value, "__self__", None)
            if isinstance(owner, str) and getattr(value, "__name__", "") in (
                "format",
                "format_map",
            ):
                _check_format(owner, "str.format")
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str) and name in _GROWING_METHODS:
                if name == "join" and args:
                    args = (_joined(args[0], owner), *args[1:])
                else:
                    _check_growth(owner, name, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


def render_here(
    template: str, messages: list[dict], add_generation_prompt: bool = True, **variables: str
) -> str:
    """Render a Hugging Face chat template (sandboxed Jinja, HF's whitespace options) with the generation prompt
    in this process, within TEMPLATE_SECONDS (an alarm between bytecodes) and TEMPLATE_CHARS; ValueError for a
    template that fails, overflows or runs too long. `render.render_chat_template` runs it in a child with hard limits."""
    import signal
    import threading

    from jinja2.exceptions import TemplateError

    _BoundedSandbox = _bounded_sandbox_class()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def timeout(signum, frame) -> None:
        raise _TemplateTimeout

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    timed = (
        threading.current_thread() is threading.main_thread()
    )  # signals reach the main thread only
    previous = signal.signal(signal.SIGALRM, timeout) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        parts, size = [], 0
        for chunk in env.from_string(template).generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        ):
            parts.append(chunk)
            size += len(chunk)
            if size > TEMPLATE_CHARS:
                raise ValueError(
                    f"chat template renders more than {TEMPLATE_CHARS:,} characters for one user turn; "
                    "refusing it"
                )
        return "".join(parts)
    except _TemplateTimeout:
        raise ValueError(
            f"chat template did not finish rendering within {TEMPLATE_SECONDS:g} s; refusing it"
        ) from None
    except (
        TemplateError,
        OverflowError,
        RecursionError,
    ) as err:  # MemoryError: the worker names its limit
        raise ValueError(
            f"chat template could not be rendered: {type(err).__name__}: {err}"
        ) from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
