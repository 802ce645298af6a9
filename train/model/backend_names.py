"""The attention backends' names, apart from the kernels so that a command's parser lists them without torch."""

from __future__ import annotations

BACKENDS = ("auto", "sdpa", "varlen", "flash", "xformers", "flex")
