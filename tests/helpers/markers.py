"""A pytest plugin for the suite's markers: every end-to-end test is also a slow one, so `make test-fast`
(`-m "not slow"`) can never run a minutes-long test that was marked e2e alone."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
