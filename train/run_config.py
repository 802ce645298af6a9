"""Pretraining run configuration: dataclasses read from YAML, with `--section.key value` overrides.

A run config is one YAML file whose sections mirror `TrainConfig` (model, data, optim,
checkpoint, logging) plus top-level run keys. Every key must exist in the dataclasses: an
unknown or mistyped key is an error naming the file (or flag) and the known keys. Command-line
flags override the file, e.g. ``--optim.lr 1e-3 --data.dir /data/shards``; values are parsed
as YAML scalars (``--checkpoint.sharded false``, ``--data.seq_len 4096``). Every number is
checked against its valid range when the config is built (each section's ``__post_init__``), so
a bad value is an error naming its key and range before any data is read.

Resuming refuses a config that differs from the checkpoint's, except in run-time keys
(`RESUMABLE_CHANGES`) and in the schedule keys of `RESUME_OVERRIDABLE`, which change only when
named explicitly: ``--resume_override optim.lr=1e-4 total_tokens=2e12`` (or ``resume_override:``
in the YAML) sets them and allows them to differ from the checkpoint.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from posfreq.train.config import ModelConfig, model_preset


class ConfigError(ValueError):
    """A run configuration that cannot work; raised before any compute."""


def _at_least(section: str, obj: Any, minimum: float, *names: str) -> None:
    """Raise ConfigError naming the first field of `names` below `minimum` (None, for unset, passes)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value >= minimum:  # `not >=` refuses NaN too
            raise ConfigError(f"{section}{name}={value!r} is out of range: it must be >= {minimum}")


@dataclass
class ModelSection:
    """Which model to train: a preset from train.config plus field overrides."""

    preset: str = "tinyllama-1.3b"
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields; vocab_size defaults to the data's
    attention_backend: str = "auto"  # train.attention backend: auto, sdpa, flash, xformers, flex
    activation_checkpointing: bool = False  # recompute each block in backward (less memory, ~1/3 more compute)
    init_from: Optional[str] = None  # start from this checkpoint's weights and trained-length histogram (fresh optimizer)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(ModelConfig)
        unknown = sorted(set(self.overrides) - set(hints))
        if unknown:
            raise ConfigError(f"model.overrides: unknown keys {unknown}. Known keys: {sorted(hints)}")
        self.overrides = {k: _coerce(v, hints[k], f"model.overrides.{k}") for k, v in self.overrides.items()}
        try:
            model_preset(self.preset, **self.overrides)
        except ValueError as err:
            raise ConfigError(f"model.overrides (preset {self.preset!r}): {err}") from None


@dataclass
class DataSection:
    """Token shards and how they are packed (see train.data.PackedSampler)."""

    dir: str = ""  # a directory written by scripts/prepare_data.py
    seq_len: int = 2048  # the training length L (rows of L tokens)
    tokenizer: Optional[str] = None  # if set, the shards must have been tokenized with it
    mix_documents: bool = True
    attention: Literal["document", "row"] = "document"
    shuffle: bool = True
    shuffle_block: int = 1 << 20

    def __post_init__(self) -> None:
        _at_least("data.", self, 2, "seq_len")  # a 1-token row has no target
        _at_least("data.", self, 1, "shuffle_block")


@dataclass
class OptimSection:
    """AdamW with linear warmup then cosine decay (the paper's TinyLlama recipe)."""

    lr: float = 4e-4
    min_lr: float = 4e-5
    warmup_steps: int = 2000
    decay_steps: Optional[int] = None  # cosine reaches min_lr here; default: the run's total steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # "all": every parameter decays, as TinyLlama's pretrain script does (AdamW over
    # model.parameters()); "matrices": only 2-D weights other than the embedding decay.
    weight_decay_scope: Literal["all", "matrices"] = "all"
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping

    def __post_init__(self) -> None:
        _at_least("optim.", self, 0, "lr", "min_lr", "warmup_steps", "eps", "weight_decay", "grad_clip")
        _at_least("optim.", self, 1, "decay_steps")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}={getattr(self, name)!r} is out of range: it must be in [0, 1)")


@dataclass
class CheckpointSection:
    """Milestones every N tokens (kept forever) and a rolling `latest` for resuming."""

    every_tokens: int = 10_000_000_000
    latest_every_steps: int = 500  # 0 disables the step trigger
    latest_every_minutes: float = 30.0  # 0 disables the time trigger
    milestone_weights_only: bool = False  # milestones keep model weights only (not resumable)
    # The newest N milestones keep the full resumable state; older ones are reduced to weights only
    # (about 4x smaller: no optimizer moments). None keeps every milestone whole.
    keep_full: Optional[int] = None
    sharded: bool = True  # torch.distributed.checkpoint shards per rank; false: one full file

    def __post_init__(self) -> None:
        _at_least("checkpoint.", self, 1, "every_tokens", "keep_full")
        _at_least("checkpoint.", self, 0, "latest_every_steps", "latest_every_minutes")


@dataclass
class LoggingSection:
    """Where metrics go: OUT/metrics.jsonl always, plus an optional logger."""

    logger: Literal["none", "csv", "wandb"] = "none"
    project: str = "posfreq"
    run_name: Optional[str] = None
    every_steps: int = 1
    progress_bar: bool = True
    peak_flops_per_device: Optional[float] = None  # for MFU; default: known GPU peak (bf16), none on CPU

    def __post_init__(self) -> None:
        _at_least("logging.", self, 1, "every_steps")


@dataclass
class TrainConfig:
    """A whole pretraining run."""

    out_dir: str = "runs/pretrain"
    seed: int = 0
    total_tokens: int = 1_000_000_000_000
    global_batch_tokens: int = 4_194_304  # 4M tokens per optimizer step, over all ranks and micro-batches
    micro_batch_rows: int = 8  # rows of L tokens per rank per forward/backward
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    devices: Union[int, str] = "auto"  # processes per node ("auto": all GPUs, or 1 on CPU)
    num_nodes: int = 1
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed"  # bf16-mixed: bf16 compute, fp32 weights/grad reduce
    resume: Optional[str] = None  # None, "auto" (newest complete checkpoint in OUT, else start), or a checkpoint dir
    stop_at_step: Optional[int] = None  # end this invocation after this step, saving `latest` (jobs, tests)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # non-finite loss or grad norm: stop, or skip that step
    requeue_on_signal: bool = True  # on SIGUSR1 under SLURM: save latest, `scontrol requeue`, exit
    resume_override: dict[str, Any] = field(default_factory=dict)  # RESUME_OVERRIDABLE keys set and allowed to change
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        _at_least("", self, 1, "total_tokens", "global_batch_tokens", "micro_batch_rows", "num_nodes", "stop_at_step")
        if not (self.devices == "auto" or (isinstance(self.devices, int) and self.devices >= 1)):
            raise ConfigError(f"devices={self.devices!r} is out of range: it must be 'auto' or an integer >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


# Keys that may change between a checkpoint and the run resuming it: they do not change the
# math of the run (which rows each step trains on, the model, the optimiser, the schedule).
RESUMABLE_CHANGES = (
    "out_dir", "resume", "stop_at_step", "micro_batch_rows", "devices", "num_nodes", "accelerator",
    "requeue_on_signal", "on_nonfinite", "resume_override", "data.dir", "model.attention_backend",
    "model.activation_checkpointing", "model.init_from", "checkpoint.", "logging.",
)
# Keys that change the schedule: they may change on resume only through --resume_override.
RESUME_OVERRIDABLE = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "total_tokens")
NOT_FLATTENED = ("overrides", "resume_override")  # dict-valued keys, not sections


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in NOT_FLATTENED:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _leaf_types(cls: type = TrainConfig, prefix: str = "") -> dict[str, Any]:
    """Every settable key (dotted) and its declared type."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            out.update(_leaf_types(hint, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hint
    return out


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a simple type hint (int, float, str, bool, Optional, Union, Literal, dict)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} matches none of {hint}")
    if hint is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in typing.get_args(hint):
            return value
        raise ConfigError(f"{key}={value!r} must be one of {list(typing.get_args(hint))}")
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint in (int, float):
        number = value
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                number = None
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if hint is float:
                return float(number)
            if float(number).is_integer():
                return int(number)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is dict or hint is dict:
        if isinstance(value, dict):
            return dict(value)
    elif hint is Any:
        return value
    raise ConfigError(f"{key}={value!r} should be of type {getattr(hint, '__name__', hint)}")


def _build(cls: type, flat: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            kwargs[f.name] = _build(hint, flat, f"{prefix}{f.name}.")
        elif f"{prefix}{f.name}" in flat:
            kwargs[f.name] = flat[f"{prefix}{f.name}"]
    return cls(**kwargs)


def config_from_dict(data: dict, where: str = "config") -> TrainConfig:
    """Build a TrainConfig from a nested dict; unknown keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of config keys, got {type(data).__name__}")
    known = _leaf_types()
    flat = _flatten(data)
    sections = {k.split(".")[0] for k in known if "." in k}
    for key in flat:
        if key in sections:
            raise ConfigError(f"{where}: {key!r} is a section; give it a mapping of keys")
    unknown = sorted(k for k in flat if k not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown config keys {unknown}. Known keys: {sorted(known)}. "
                          "Fix: correct the spelling or remove them.")
    try:
        overrides = _resume_overrides(flat.pop("resume_override", {}))
        typed = {k: _coerce(v, known[k], k) for k, v in {**flat, **overrides}.items()}
        return _build(TrainConfig, {**typed, "resume_override": {k: typed[k] for k in overrides}})
    except ConfigError as err:  # a wrong type, or a value out of range (the sections' __post_init__)
        raise ConfigError(f"{where}: {err}") from None


def _resume_overrides(overrides: Any) -> dict[str, Any]:
    """The `resume_override` mapping, checked: only RESUME_OVERRIDABLE keys may be overridden."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"resume_override={overrides!r} should be a mapping of KEY: VALUE")
    other = sorted(set(overrides) - set(RESUME_OVERRIDABLE))
    if other:
        raise ConfigError(f"resume_override: {other} cannot change on resume; only {list(RESUME_OVERRIDABLE)} "
                          "can (the rest would change the model, the data stream or the optimizer)")
    return overrides


def _key_value(text: str) -> tuple[str, Any]:
    """Parse one `--resume_override` item, KEY=VALUE (VALUE a YAML scalar)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. optim.lr=1e-4)")
    return key, yaml.safe_load(value)


def load_yaml(path: str | Path) -> dict:
    """Read one YAML mapping (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{key}: {part!r} is not a section")
    node[parts[-1]] = value


def build_parser() -> argparse.ArgumentParser:
    """`--config FILE` plus one `--dotted.key VALUE` flag per config field."""
    parser = argparse.ArgumentParser(
        prog="python train/pretrain.py",
        description="Pretrain a TinyLlama-style model (Lightning Fabric + FSDP2). Values are YAML scalars.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML run config (configs/*.yaml)")
    defaults = _flatten(TrainConfig().to_dict())
    parser.add_argument("--resume_override", dest="resume_override", metavar="KEY=VALUE", nargs="+",
                        action="extend", type=_key_value,
                        help=f"set and allow a change on resume of any of {', '.join(RESUME_OVERRIDABLE)}")
    for key, hint in _leaf_types().items():
        if key == "resume_override":
            continue
        parser.add_argument(f"--{key}", dest=key, metavar="VALUE", type=yaml.safe_load,
                            help=f"{getattr(hint, '__name__', str(hint))}, default {defaults.get(key)!r}")
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The run config from `--config FILE` and command-line overrides."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config", None)
    data = load_yaml(path) if path else {}
    for key, value in args.items():
        if key == "model.overrides" and isinstance(value, dict):
            data.setdefault("model", {}).setdefault("overrides", {}).update(value)
        elif key == "resume_override":
            data.setdefault("resume_override", {}).update(value)
        else:
            _set_dotted(data, key, value)
    return config_from_dict(data, where=f"{path or 'command line'} + command-line overrides")


def config_differences(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ between two config dicts, ignoring RESUMABLE_CHANGES and the keys `current`
    overrides (its resume_override); a RESUME_OVERRIDABLE key names the flag that would allow its change."""
    a, b = _flatten(saved), _flatten(current)
    allowed = set(current.get("resume_override", {}))
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in allowed or any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_CHANGES):
            continue
        if a.get(key) != b.get(key):
            hint = f" (to change it on resume: --resume_override {key}={b.get(key)})" \
                if key in RESUME_OVERRIDABLE else ""
            diffs.append(f"{key}: checkpoint {a.get(key)!r} vs now {b.get(key)!r}{hint}")
    return diffs


def overridden_changes(saved: dict, current: dict) -> list[str]:
    """The RESUME_OVERRIDABLE keys `current` overrides to a value other than the checkpoint's, as 'key: old -> new'."""
    a, b = _flatten(saved), _flatten(current)
    return [f"{key}: {a.get(key)!r} -> {b.get(key)!r}" for key in current.get("resume_override", {})
            if a.get(key) != b.get(key)]
