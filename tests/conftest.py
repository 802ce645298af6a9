"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on a shared 2-core machine more threads make tiny steps ~10x slower, and
    OMP_NUM_THREADS=1 stops Fabric's launcher from giving each process cpu_count // processes threads."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env
