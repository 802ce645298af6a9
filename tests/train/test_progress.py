import io

from posfreq.train import progress as progress_module
from posfreq.train.progress import progress_bar


def test_a_log_file_gets_whole_lines_the_first_and_the_last_state(monkeypatch):
    """In a file there is no carriage return: the bar's start and end as lines, and between them at most one line
    per LOG_EVERY_S (here nothing passes it)."""
    log = io.StringIO()
    with progress_bar(stream=log, total=1000, desc="probe", unit="test") as bar:
        for i in range(1000):
            bar.update(1)
            bar.set_postfix_str(f"length {i}")  # a redraw each time, as the probe and prepare ask
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and 1 <= len(lines) <= 2
    assert (
        lines[-1].startswith("probe: 100%")
        and "1000/1000" in lines[-1]
        and "length 999" in lines[-1]
    )


def test_a_line_per_interval(monkeypatch):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    log = io.StringIO()
    with progress_bar(stream=log, total=3, desc="tokenize", mininterval=0) as bar:
        for _ in range(3):
            bar.update(1)
    states = [line.split("|")[0] for line in log.getvalue().splitlines()]
    assert states[:4] == ["tokenize:   0%", "tokenize:  33%", "tokenize:  67%", "tokenize: 100%"]
    assert set(states[4:]) <= {"tokenize: 100%"}  # the close redraws the end


def test_a_terminal_gets_tqdms_own_bar():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    with progress_bar(stream=screen, total=2) as bar:
        bar.update(2)
    assert "\r" in screen.getvalue()


def test_a_bar_that_does_not_stay_still_logs_its_end_and_nested_bars_log_no_escape_codes():
    log = io.StringIO()
    with progress_bar(stream=log, total=5, desc="inner", leave=False) as bar:
        bar.update(5)
    assert log.getvalue().splitlines()[-1].startswith("inner: 100%")
    nested = io.StringIO()
    with progress_bar(stream=nested, total=2, desc="outer") as outer:
        with progress_bar(stream=nested, total=2, desc="inner", position=1, leave=False) as inner:
            inner.update(2)
        outer.update(2)
    assert "\x1b" not in nested.getvalue() and "outer: 100%" in nested.getvalue()


def test_a_process_that_imported_a_notebook_kernel_is_not_a_notebook():
    """Running a notebook's test imports IPython and ipykernel into the test process; its bars stay lines."""
    import importlib.util

    if importlib.util.find_spec("IPython") is not None:
        import IPython  # noqa: F401

    log = io.StringIO()
    with progress_bar(stream=log, total=2, desc="x") as bar:
        bar.update(2)
    assert "\r" not in log.getvalue() and log.getvalue().startswith("x:")
