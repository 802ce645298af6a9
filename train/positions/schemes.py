"""Position schemes: which relative distance the rotary embedding sees for each (query, key).

What the model needs from a scheme is two methods: `rotate_keys` (keys are rotated, and
cached, at their true positions with the scheme's `rotary`: its frequencies and cos/sin scale)
and `attend` (the scheme's attention over packed sequences, given the un-rotated queries: it
decides how to rotate them, and over which keys, so that each (query m, key n <= m) pair of a
document sees the scheme's distance). The model never asks which scheme it runs. Every scheme
also has `distances(L)`, the reference (L, L) matrix of those distances. Schemes are built by
`build_scheme` on the model's `RotaryBase` (train/positions/rotary.py): all but ntk and yarn keep the
model's own frequencies, rope_scaling included; ntk and yarn replace them, so they refuse a
model that carries a rope_scaling.

- ``rope``: m - n.
- ``string`` (STRING, An et al. 2024): m - n below the shift S, m - n - S + W at or beyond it.
- ``rerope`` (Su 2023): min(m - n, w).
- ``self_extend`` (Jin et al. 2024): m - n below the neighbour window W_n, grouped
  m // G - n // G + W_n - W_n // G beyond it.
- ``dca`` (dual chunk attention, An et al. 2024a): intra-chunk, successive-chunk and
  inter-chunk distances over chunks of the document.
- ``ntk`` and ``yarn``: m - n with rescaled RoPE frequencies (and YaRN's temperature).

The schemes that rewrite distances run as several causal attention passes over packed
sequences (`varlen_attention`), each with its own query rotation and key set, merged exactly
through their log-sum-exp, so every key is counted once per query. STRING's cached decoding
(new queries after a KV cache) instead runs in one pass per layer (`StringScheme.decode`):
both query rotations scored against slices of the cached keys, one softmax, one matmul with V.

The extrapolation baselines (ntk, yarn, rerope, self_extend, dca) take ``protocol``:
``"paper"`` (default) is the STRING paper's evaluation protocol, which treats the training
length as 2/3 of the true one and the extension factor as 3/2 so the methods act inside the
training window; ``"native"`` keeps the true training length and factor 1 (ntk, yarn and
self_extend then equal rope).
"""

from __future__ import annotations

import inspect
import math
from typing import get_type_hints

from posfreq.train.positions.dca import DualChunkScheme
from posfreq.train.positions.names import SCHEMES
from posfreq.train.positions.rotary import Rotary, RotaryBase, ntk_inv_freq, yarn_parameters
from posfreq.train.positions.scheme import PositionScheme, ReRoPEScheme, SelfExtendScheme
from posfreq.train.positions.string import STRING_TEMPERATURE, StringScheme, string_shift_window

PROTOCOLS = ("paper", "native")


def extrapolation_setting(train_len: int, protocol: str, scale: float | None) -> tuple[int, float]:
    """(training length the method assumes, extension factor) under an evaluation protocol.

    "paper": 2/3 of the true training length and factor 3/2 (the STRING paper's baselines),
    so the test length equals the true training length. "native": the true length, factor 1.
    An explicit `scale` overrides the factor in both.
    """
    if protocol == "paper":
        return round(2 * train_len / 3), 1.5 if scale is None else scale
    if protocol == "native":
        return train_len, 1.0 if scale is None else scale
    raise ValueError(f"unknown protocol {protocol!r}; choose one of {PROTOCOLS}")


def _check(condition: bool, message: str) -> None:
    """Refuse an option value with `message` unless `condition` holds."""
    if not condition:
        raise ValueError(message)


def _own_frequencies(name: str, rope: RotaryBase) -> None:
    """Refuse a scheme that replaces RoPE's frequencies on a model whose frequencies carry a rope_scaling."""
    _check(
        not rope.scaled,
        f"{name} replaces RoPE's frequencies; it cannot be combined with this model's "
        f"rope_scaling {rope.scaling}",
    )


def _string(
    rope: RotaryBase,
    train_len: int,
    shift: int | None = None,
    window: int | None = None,
    temperature: bool = False,
) -> StringScheme:
    """STRING over the model's frequencies; shift S = L // 3, window W = min(128, S // 2) by default."""
    shift, window = string_shift_window(train_len, shift, window)
    scale = STRING_TEMPERATURE if temperature else 1.0
    options = dict(shift=shift, window=window, temperature=bool(temperature))
    return StringScheme(
        "string", Rotary(rope.inv_freq(), scale), options, split=shift, window=window
    )


def _rerope(
    rope: RotaryBase, train_len: int, window: int | None = None, protocol: str = "paper"
) -> ReRoPEScheme:
    """ReRoPE over the model's frequencies; window min(512, L' // 4) by default."""
    length, _ = extrapolation_setting(train_len, protocol, None)
    window = min(512, length // 4) if window is None else int(window)
    _check(window >= 1, f"rerope: window must be >= 1, got {window}")
    options = dict(window=window, protocol=protocol)
    return ReRoPEScheme("rerope", rope.rotary(), options, split=window)


def _self_extend(
    rope: RotaryBase,
    train_len: int,
    group: int | None = None,
    window: int | None = None,
    protocol: str = "paper",
    scale: float | None = None,
) -> SelfExtendScheme:
    """Self-Extend over the model's frequencies; window min(512, L' // 4), the smallest group that fits."""
    length, factor = extrapolation_setting(train_len, protocol, scale)
    window = min(512, length // 4) if window is None else int(window)
    _check(1 <= window < length, f"self_extend: need 1 <= window < {length}, got {window}")
    # Smallest group keeping every distance of a factor * length input below the assumed length.
    group = (
        max(1, math.ceil((factor * length - window) / (length - window)))
        if group is None
        else int(group)
    )
    _check(group >= 1, f"self_extend: group must be >= 1, got {group}")
    options = dict(group=group, window=window, protocol=protocol, scale=factor)
    return SelfExtendScheme("self_extend", rope.rotary(), options, split=window, group=group)


def _dca(
    rope: RotaryBase,
    train_len: int,
    chunk_size: int | None = None,
    local_window: int | None = None,
    protocol: str = "paper",
) -> DualChunkScheme:
    """Dual chunk attention over the model's frequencies; chunk_size 3L' // 4, local_window L' // 16 by default."""
    length, _ = extrapolation_setting(train_len, protocol, None)
    chunk_size = length * 3 // 4 if chunk_size is None else int(chunk_size)
    local_window = length // 16 if local_window is None else int(local_window)
    _check(
        0 <= local_window < chunk_size,
        f"dca: need 0 <= local_window < chunk_size, got {local_window}, {chunk_size}",
    )
    options = dict(chunk_size=chunk_size, local_window=local_window, protocol=protocol)
    return DualChunkScheme(
        "dca", rope.rotary(), options, chunk_size=chunk_size, local_window=local_window
    )


def _ntk(
    rope: RotaryBase, train_len: int, scale: float | None = None, protocol: str = "paper"
) -> PositionScheme:
    """RoPE distances with NTK-aware frequencies in place of the model's."""
    _own_frequencies("ntk", rope)
    _, factor = extrapolation_setting(train_len, protocol, scale)
    _check(factor >= 1, f"ntk: scale must be >= 1, got {factor}")
    inv_freq = ntk_inv_freq(rope.head_dim, rope.base, factor)
    return PositionScheme("ntk", Rotary(inv_freq), dict(scale=factor, protocol=protocol))


def _yarn(
    rope: RotaryBase,
    train_len: int,
    scale: float | None = None,
    protocol: str = "paper",
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> PositionScheme:
    """RoPE distances with YaRN's frequencies and attention temperature in place of the model's."""
    _own_frequencies("yarn", rope)
    length, factor = extrapolation_setting(train_len, protocol, scale)
    _check(factor >= 1, f"yarn: scale must be >= 1, got {factor}")
    inv_freq, attention_factor = yarn_parameters(
        rope.head_dim, rope.base, factor, length, beta_fast, beta_slow
    )
    options = dict(
        scale=factor,
        original_len=length,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        protocol=protocol,
    )
    return PositionScheme("yarn", Rotary(inv_freq, attention_factor), options)


def _rope(rope: RotaryBase, train_len: int) -> PositionScheme:
    """Plain RoPE with the model's own frequencies."""
    return PositionScheme("rope", rope.rotary())


_BUILDERS = {
    "rope": _rope,
    "string": _string,
    "rerope": _rerope,
    "self_extend": _self_extend,
    "dca": _dca,
    "ntk": _ntk,
    "yarn": _yarn,
}

SINGLE_PASS_SCHEMES = tuple(
    name for name, build in _BUILDERS.items() if get_type_hints(build)["return"].single_pass
)
"""Schemes whose attention is one causal pass (their class says so: `PositionScheme.single_pass`); the others
merge passes by their log-sum-exp."""


def build_scheme(name: str, rope: RotaryBase, train_len: int, **options) -> PositionScheme:
    """A position scheme by name with its options, on the model's rotary base; `train_len` (L) sets the defaults.

    rope: none. string: shift=L//3, window=min(128, shift//2), temperature=False.
    rerope: window=min(512, L'//4). self_extend: window=min(512, L'//4), group=smallest keeping
    distances of a scale*L' input below L', scale. dca: chunk_size=3L'//4, local_window=L'//16.
    ntk: scale. yarn: scale, beta_fast=32, beta_slow=1. The baselines also take protocol=
    "paper" (default: L' = 2L/3, scale 3/2) or "native" (L' = L, scale 1). ntk and yarn replace
    the model's frequencies, so they refuse a model whose `rope` carries a rope_scaling.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown position scheme {name!r}; choose one of {SCHEMES}")
    builder = _BUILDERS[name]
    allowed = list(inspect.signature(builder).parameters)[2:]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name} does not take {unknown}; its options are {allowed}")
    return builder(rope, train_len, **options)
