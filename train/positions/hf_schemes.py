"""Every position scheme in a transformers model, through one call: `apply_scheme(model, name, **options)`.

STRING has its own attention function (train/positions/string_hf.py). ntk and yarn are RoPE with frequencies of
their own: the model's rotary embedding takes the scheme's Rotary and attention stays transformers' sdpa. The
two-pass schemes (rerope, self_extend, dca) run through the attention function "posfreq_scheme", which calls
posfreq's own scheme object (`scheme.attend`, train/positions/schemes.py) inside any transformers decoder (Llama,
Mistral, Qwen2, ...).

transformers rotates q and k at their positions with the model's rotary before it calls the attention function.
Rotations compose, so the function turns the queries back (R(-p) R(p) = 1) and hands the scheme each token's
position in its row, with the keys as cached: rotated with the model's frequencies, which is what those schemes'
`rotate_keys` gives (a scheme with frequencies of its own set by hand as the attention implementation gets its
keys turned back and rotated again). The scheme then rotates its queries as it does in posfreq's own model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posfreq.train.checkpoint.safe_load import first_non_finite, non_finite_message
from posfreq.train.model.hf_folder import (
    ModelFolderError,
    check_weight_files,
    refuse_custom_code,
    transformers_config,
)
from posfreq.train.positions.hf_rows import (
    attention_inputs,
    head_dim,
    packed,
    plain_attention,
    refuse_unsupported,
    rope_inv_freq,
    rope_parameters,
    scaled_queries,
    unpack_queries,
    uses_rope,
)
from posfreq.train.positions.rotary import ROPE_SCALING_TYPES, Rotary, RotaryBase
from posfreq.train.positions.scheme import PositionScheme
from posfreq.train.positions.schemes import SCHEMES, build_scheme
from posfreq.train.positions.string import string_shift_window
from posfreq.train.positions.string_hf import apply_string

SCHEME_ATTENTION = "posfreq_scheme"
CONFIG_KEY = (
    "posfreq_scheme"  # {"name": ..., "train_len": L, "options": {...}}, set by apply_scheme
)


def rotary_base(config: Any) -> RotaryBase:
    """posfreq's RotaryBase for a transformers config: its head size, theta and static rope scaling."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"posfreq_scheme: this model's rope type {rope_type!r} is not one posfreq's schemes are built on "
            f"({', '.join(ROPE_SCALING_TYPES)}). Fix: use rope or string with this model"
        )
    return RotaryBase(
        head_dim(config), float(params["rope_theta"]), params if rope_type != "default" else None
    )


def _scheme(module: torch.nn.Module) -> tuple[PositionScheme, Rotary, bool]:
    """(posfreq's scheme for this module's config, the model's own rotary, whether the cached keys are already
    rotated as the scheme rotates keys), made once per module and settings."""
    stored = getattr(module.config, CONFIG_KEY)
    key = json.dumps(stored, sort_keys=True)
    cached = getattr(module, "_posfreq_scheme", None)
    if cached is None or cached[0] != key:
        scheme = build_scheme(
            stored["name"], rotary_base(module.config), stored["train_len"], **stored["options"]
        )
        model = Rotary(rope_inv_freq(module.config))
        same = scheme.rotary.scale == 1.0 and torch.allclose(
            scheme.rotary.inv_freq.float(), model.inv_freq, rtol=1e-6, atol=0
        )
        cached = (key, scheme, model, same)
        module._posfreq_scheme = cached
    return cached[1], cached[2], cached[3]


def _turn_back(rotary: Rotary, x: Tensor, positions: Tensor) -> Tensor:
    """Vectors (T, H, D) rotated at `positions` by `rotary`, un-rotated (in float32)."""
    return rotary.rotate(x.float(), -positions).to(x.dtype)


def scheme_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: q (B, H, Lq, D), cached k/v (B, Hkv, Lk, D), a boolean mask
    (B, 1, Lq, Lk) or None; returns (B, Lq, H, D), zeros for padding queries. Each row's real tokens are packed
    and attended by posfreq's scheme, at their positions in the row."""
    refuse_unsupported(kwargs)
    backend = (getattr(module.config, CONFIG_KEY, None) or {}).get("backend", "auto")
    if not uses_rope(module):
        return plain_attention(query, key, value, attention_mask, scaling, backend), None
    scheme, model_rotary, keys_as_cached = _scheme(module)
    layout, q, k, v = packed(query, key, value, attention_mask)
    q = scaled_queries(_turn_back(model_rotary, q, layout.pos_q), scaling)
    if not keys_as_cached:  # ntk, yarn set as the attention implementation by hand
        k = scheme.rotate_keys(_turn_back(model_rotary, k, layout.pos_k), layout.pos_k)
    inputs = attention_inputs(layout, q, k, v, layout.pos_q, layout.pos_k, backend)
    return unpack_queries(scheme.attend(inputs), layout, query, key.shape[2]), None


def register() -> None:
    """Make `attn_implementation="posfreq_scheme"` known to transformers (a boolean mask, as for sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SCHEME_ATTENTION, scheme_attention)
    AttentionMaskInterface.register(SCHEME_ATTENTION, sdpa_mask)


def scheme_options(config: Any, name: str, train_len: int, **options: Any) -> dict:
    """The options scheme `name` runs with on a model of this transformers config (the given ones and every
    default, as build_scheme resolves them); ValueError names a bad one. Needs no weights: the check a command
    makes before it loads a model."""
    if name not in SCHEMES:
        raise ValueError(f"unknown position scheme {name!r}; choose one of {SCHEMES}")
    # rope is the model's own attention, whatever its rotary (or none): nothing of posfreq's to check
    if name == "rope":
        if options:
            raise ValueError(f"rope does not take {sorted(options)}; it has no options")
        return {}
    rope_inv_freq(
        config
    )  # refuses rotary embeddings the schemes cannot turn back (partial, dynamic)
    if name == "string":  # string_hf's function: S and W (no temperature)
        unknown = sorted(set(options) - {"shift", "window"})
        if unknown:
            raise ValueError(f"string through transformers takes shift and window, not {unknown}")
        shift, window = string_shift_window(train_len, options.get("shift"), options.get("window"))
        return {"shift": shift, "window": window}
    return dict(build_scheme(name, rotary_base(config), train_len, **options).options)


OWN_FREQUENCIES = ("ntk", "yarn")
"""Schemes that are RoPE with frequencies (and a cos/sin scale) of their own: the model's rotary embedding takes the
scheme's Rotary, so keys are cached rotated as the scheme rotates them and attention is transformers' sdpa
(equal to the scheme's one-pass `attend`), with no key re-rotated at each step."""


def _set_rotary(model: Any, rotary: Rotary | None) -> None:
    """Give every rotary embedding of `model` the scheme's inverse frequencies and scale, or (None) its own back."""
    for module in model.modules():
        if not (hasattr(module, "inv_freq") and hasattr(module, "attention_scaling")):
            continue
        own = getattr(module, "_posfreq_own_rotary", None)
        if own is None:
            own = (module.inv_freq.detach().clone(), module.attention_scaling)
            module._posfreq_own_rotary = own
        inv_freq, scale = own if rotary is None else (rotary.inv_freq, rotary.scale)
        module.inv_freq = inv_freq.to(device=module.inv_freq.device, dtype=module.inv_freq.dtype)
        module.original_inv_freq = module.inv_freq.clone()
        module.attention_scaling = float(scale)


def _own_attention(model: Any) -> Any:
    """`model` back on transformers' own attention: sdpa, or eager for a model transformers runs only eagerly."""
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):  # transformers refuses sdpa by name (Gemma 2's softcapping)
        model.set_attn_implementation("eager")
    return model


def apply_scheme(model: Any, name: str, train_len: int | None = None, **options: Any) -> Any:
    """Run a loaded transformers model with position scheme `name` and its options (build_scheme's), defaults
    from `train_len` (default: the config's max_position_embeddings). rope is the model's own attention as
    transformers runs it (sdpa, or eager for a model without sdpa), on any decoder; string is string_hf's
    function (shift and window). Bad options are refused here, before any forward."""
    if name == "rope":
        scheme_options(model.config, name, 0, **options)
        _set_rotary(model, None)
        return _own_attention(model)
    length = train_len or model.config.max_position_embeddings
    resolved = scheme_options(model.config, name, length, **options)
    frequencies = None
    if (
        name in OWN_FREQUENCIES
    ):  # one causal pass with the scheme's frequencies: in the model's rotary embedding
        frequencies = build_scheme(name, rotary_base(model.config), length, **options).rotary
    _set_rotary(model, frequencies)
    if name == "string":
        return apply_string(model, resolved["shift"], resolved["window"], length)
    if frequencies is not None:
        model.set_attn_implementation("sdpa")
        return model
    register()
    setattr(model.config, CONFIG_KEY, {"name": name, "train_len": length, "options": options})
    model.set_attn_implementation(SCHEME_ATTENTION)
    return model


def load_causal_lm(
    path: str | Path,
    positions: str = "rope",
    train_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> Any:
    """A local transformers model in eval mode with position scheme `positions` (`apply_scheme`); the loader the
    probe's transformers engine, `posfreq ruler` and `posfreq loss-by-distance` share. Folder code is refused, and
    the scheme's options and the architecture are checked on the config before any weight is read."""
    from transformers import AutoModelForCausalLM

    if positions not in SCHEMES:
        raise ValueError(f"unknown position scheme {positions!r}; choose one of {SCHEMES}")
    from transformers.utils import logging as hf_logging

    refuse_custom_code(Path(path), "the model folder")
    # a damaged config.json, an unknown model type or a damaged weight file named, before any weight is read
    config = transformers_config(path)
    check_weight_files(path)
    length = train_len or (0 if positions == "rope" else config.max_position_embeddings)
    scheme_options(config, positions, length, **options)
    hf_logging.disable_progress_bar()  # the weights' loading bar would break the callers' own progress bars
    # rope keeps the attention transformers picks for the model (sdpa where it runs); the schemes set their own
    attention = {} if positions == "rope" else {"attn_implementation": "sdpa"}
    model = AutoModelForCausalLM.from_pretrained(  # safetensors only: never a pickle, whatever lies beside it
        path, config=config, dtype=dtype, trust_remote_code=False, use_safetensors=True, **attention
    )
    found = first_non_finite(model.state_dict().items())
    if found:
        raise ModelFolderError(non_finite_message(str(path), found))
    return apply_scheme(model, positions, train_len, **options).eval()
