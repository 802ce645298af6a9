"""The rotary base: RoPE's inverse frequencies, their scalings, and the rotation by cos/sin.

`RotaryBase` is a model's own rotary embedding (head dim, base, Hugging Face `rope_scaling`),
`Rotary` rotates vectors with a given set of inverse frequencies (Llama's half-split layout).
The frequency formulas live here once: plain RoPE, Hugging Face's ``linear`` and ``llama3``
scalings (what imported checkpoints carry), and the NTK-aware and YaRN frequencies that the
``ntk`` and ``yarn`` position schemes (train/positions/schemes.py) put in their place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo
from posfreq.train.model.fused import fused, rotate

ROPE_SCALING_TYPES = ("default", "linear", "llama3")
"""The Hugging Face `rope_scaling` types a model may carry (others are refused on import)."""


def rotary_inv_freq(head_dim: int, base: float) -> Tensor:
    """RoPE's inverse frequencies base^(-2j/d), float32, as Llama computes them."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


RECENT_POSITIONS = 2
"""How many positions tensors' cos/sin a `Rotary` keeps (see `Rotary._recent`)."""


@dataclass
class Rotary:
    """Rotates vectors by their positions: x * cos + rotate_half(x) * sin (Llama's half-split layout)."""

    inv_freq: Tensor
    scale: float = 1.0
    """Multiplies cos/sin (YaRN's attention temperature, so logits by its square); 1 for plain RoPE."""
    _recent: LayoutMemo = field(
        default_factory=lambda: LayoutMemo(RECENT_POSITIONS), init=False, repr=False, compare=False
    )
    """cos/sin of the last RECENT_POSITIONS positions tensors, known by identity: every layer of a forward rotates
    at the same positions tensors (a split scheme at two: the true positions and its far queries'), so they are
    computed once per forward, not once or twice per layer (a tenth of a single-token decoding step of a 135M model
    on a CPU). Positions tensors are never changed in place."""

    _on_device: dict[torch.device, Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """inv_freq per device it was used on: a host-to-device copy blocks the host until the GPU has caught up,
    which would cost every rotation at new positions (STRING's far queries, every layer) its CPU run-ahead."""

    _unscaled: "Rotary | None" = field(default=None, init=False, repr=False, compare=False)
    """These frequencies without `scale`, for `rerotate`."""

    def inv_freq_on(self, device: torch.device) -> Tensor:
        """inv_freq on `device`, copied there once."""
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin, each (T, 1, D), at `positions` (T,), times `scale`, in `dtype`."""
        return self._recent.get((positions,), (dtype,), lambda: self._cos_sin(positions, dtype))

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq_on(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (
            (emb.cos() * self.scale).to(dtype)[:, None, :],
            (emb.sin() * self.scale).to(dtype)[:, None, :],
        )

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (T, H, D) rotated at `positions` (T,), which may be any integers, negative included."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return fused(rotate)(x, cos, sin)

    def rerotate(self, x: Tensor, shift: Tensor) -> Tensor:
        """Rotate already rotated vectors further by `shift` (rotations compose), in float32, without `scale` again."""
        if self._unscaled is None:  # one, so that its cos/sin memo serves every layer
            self._unscaled = Rotary(self.inv_freq)
        return self._unscaled.rotate(x.float(), shift).to(x.dtype)


@dataclass(frozen=True)
class RotaryBase:
    """A model's own rotary embedding: what its weights were trained (or imported) with."""

    head_dim: int
    base: float = 10_000.0
    """RoPE's theta."""
    scaling: dict | None = field(default=None, hash=False)
    """Hugging Face's rope_scaling dict of an imported model (None or type "default": unscaled)."""

    @property
    def scaled(self) -> bool:
        """Whether the frequencies carry a rope_scaling (so a scheme may not replace them)."""
        return rope_scaling_type(self.scaling) != "default"

    def inv_freq(self) -> Tensor:
        """The model's inverse frequencies, its rope_scaling applied."""
        return scaled_inv_freq(rotary_inv_freq(self.head_dim, self.base), self.scaling)

    def rotary(self) -> Rotary:
        """Plain RoPE with the model's own frequencies."""
        return Rotary(self.inv_freq())


# ----------------------------------------------------------------------------- Hugging Face rope_scaling


def rope_type_of(rope_scaling: dict | None) -> str:
    """The scaling type a rope_scaling dict names (HF spells it rope_type, older files type), whatever it is."""
    return (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))


def rope_scaling_type(rope_scaling: dict | None) -> str:
    """The scaling type of a rope_scaling dict (`rope_type_of`); refuses types posfreq does not compute."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r} (rope_scaling={rope_scaling}); supported: {ROPE_SCALING_TYPES}"
        )
    return rope_type


def llama3_inv_freq(
    inv_freq: Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> Tensor:
    """Llama-3.1's rope scaling: divide low frequencies by `factor`, keep high ones, interpolate between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def scaled_inv_freq(inv_freq: Tensor, rope_scaling: dict | None) -> Tensor:
    """Apply a Hugging Face `rope_scaling` dict (none/default, linear, llama3) to RoPE's inverse frequencies."""
    rope_type = rope_scaling_type(rope_scaling)
    if rope_type == "default":
        return inv_freq
    try:
        if rope_type == "linear":
            return inv_freq / float(rope_scaling["factor"])
        return llama3_inv_freq(
            inv_freq,
            float(rope_scaling["factor"]),
            float(rope_scaling["low_freq_factor"]),
            float(rope_scaling["high_freq_factor"]),
            int(rope_scaling["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} lacks the key {err.args[0]!r}: {rope_scaling}"
        ) from err


# ----------------------------------------------------------------------------- extrapolation frequencies


def ntk_inv_freq(head_dim: int, base: float, scale: float) -> Tensor:
    """NTK-aware RoPE: the base raised to base * scale^(d / (d - 2))."""
    return rotary_inv_freq(head_dim, base * scale ** (head_dim / (head_dim - 2)))


def yarn_parameters(
    head_dim: int,
    base: float,
    scale: float,
    original_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> tuple[Tensor, float]:
    """YaRN's per-band inverse frequencies and attention factor, as Hugging Face computes them.

    Bands rotating more than beta_fast times over original_len keep their frequency, those
    rotating less than beta_slow times are interpolated by 1/scale, with a linear ramp between;
    the attention factor 0.1 ln(scale) + 1 multiplies cos and sin (logits by its square).
    """

    def correction_dim(rotations: float) -> float:
        """The (fractional) dimension whose band turns `rotations` times over original_len."""
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scale * pos_freqs)
    top = high + 0.001 if high == low else high  # avoid a zero-width ramp, as Hugging Face does
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (top - low)).clamp(0, 1)
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    factor = 1.0 if scale <= 1 else 0.1 * math.log(scale) + 1.0
    return inv_freq, factor
