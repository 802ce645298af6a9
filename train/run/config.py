"""Pretraining run configuration: dataclasses, read from YAML and flags by jsonargparse.

A run config is one YAML file whose sections mirror `TrainConfig` (model, data, optim,
checkpoint, logging) plus top-level run keys; `posfreq pretrain --help` lists every key with its
description, allowed values and default, and `--print-config` prints the resolved config. Flags
override the file: ``--optim.lr 1e-3 --data.dir /data/shards``. An unknown or mistyped key is an
error naming it; every number is checked against its valid range when the config is built (each
section's ``__post_init__``), before any data is read.

Resuming refuses a config that differs from the checkpoint's, except in run-time keys
(train/run/resume_changes.py's `RESUMABLE_CHANGES`) and in the schedule keys of `RESUME_OVERRIDABLE`, which change only when
named explicitly: ``--resume-override "{optim.lr: 1e-4, total_tokens: 2e12}"`` (or
``resume_override:`` in the YAML) sets them and allows them to differ from the checkpoint.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Optional, Sequence, Union

from jsonargparse import ArgumentParser, Namespace

from posfreq.train.command_line import CodeInConfig, command_parser, parse, refuse_code
from posfreq.train.data.packing_schedule import RowPacking
from posfreq.train.data.packing_strategies import TOKEN_STREAMS, Strategy
from posfreq.train.data.upsample import LengthUpsample
from posfreq.train.model.backend_names import BACKENDS
from posfreq.train.model.config import ModelConfig, model_preset
from posfreq.train.run.resume_changes import RESUME_OVERRIDABLE


class ConfigError(ValueError):
    """A run configuration that cannot work; raised before any compute."""


Scalar = Union[bool, int, float, str, None]
"""A config value that is data: the only kind a free-form mapping (model.overrides, resume_override) may hold, so
jsonargparse never resolves one as a class to instantiate."""


MAX_TOKENS = 2**53
"""The largest token count a run takes: float64 (metrics, JSON, the plan's arithmetic) holds every integer up to it."""


def _at_least(section: str, obj: Any, minimum: float, *names: str) -> None:
    """Raise ConfigError naming the first field of `names` below `minimum` or infinite (None, for unset, passes)."""
    for name in names:
        value = getattr(obj, name)
        # `not >=` refuses NaN too; an infinite learning rate or count is no setting either
        if value is not None and (not value >= minimum or math.isinf(value)):
            raise ConfigError(
                f"{section}{name}={value!r} is out of range: it must be a finite number >= {minimum}"
            )


def _number(value: Any, hint: Any, key: str) -> Any:
    """`value` as the int or float `hint` asks for (YAML may give 1e-3 as a string), else ConfigError."""
    if hint not in (int, float) or isinstance(value, bool):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} should be a number") from None
    if hint is int:
        if not number.is_integer():
            raise ConfigError(f"{key}={value!r} should be an integer")
        return int(number)
    return number


@dataclass
class ModelSection:
    """Which model to train: a preset from posfreq.train.model.config plus field overrides."""

    preset: str = "tinyllama-1.3b"
    """A model preset name (posfreq.train.model.config.PRESETS), e.g. tinyllama-1.3b, tiny-2l-128."""
    overrides: dict[str, Scalar] = field(default_factory=dict)
    """ModelConfig fields that replace the preset's, e.g. {n_layers: 2}; vocab_size defaults to the data's."""
    attention_backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]
    """Attention backend (posfreq.train.model.attention): auto picks, by device and dtype, the first of varlen (torch's
    FlashAttention), flash, sdpa that can train; checked before launch."""
    activation_checkpointing: bool = False
    """Recompute each block in backward: less activation memory for about 1/3 more compute."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Fuse each block's RMSNorms, rotary rotations and SwiGLU gate with torch.compile (posfreq.train.model.fused):
    auto means on CUDA, where unfused they cost a large share of a step, and off on CPU."""
    init_from: Optional[str] = None
    """Start from this checkpoint's weights and trained-length histogram (with a fresh optimizer)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(ModelConfig)
        unknown = sorted(set(self.overrides) - set(hints))
        if unknown:
            raise ConfigError(
                f"model.overrides: unknown keys {unknown}. Known keys: {sorted(hints)}"
            )
        if "train_len" in self.overrides:
            raise ConfigError(
                "model.overrides.train_len: the training length has one name and one place, "
                "data.train_len (the model records it from there). Fix: set data.train_len instead."
            )
        self.overrides = {
            k: _number(v, hints[k], f"model.overrides.{k}") for k, v in self.overrides.items()
        }
        try:
            model_preset(self.preset, **self.overrides)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.overrides (preset {self.preset!r}): {err}") from None


MAX_TRAIN_LEN = 1 << 22
"""The longest training length (tokens per row) posfreq plans or analyses: the paper's are 2K and 4K, and a
trained-length histogram or Eq. 2 of this many positions is tens of megabytes. A larger value is refused before
any array of its size is made."""


@dataclass
class DataSection:
    """Token shards and how they are packed into rows (see posfreq.train.data.packing)."""

    dir: str = ""
    """A directory of token shards written by `posfreq prepare`."""
    train_len: int = 2048
    """The training length L: rows of L tokens (written into every checkpoint)."""
    tokenizer: Optional[str] = None
    """If set, the shards must have been tokenized with this tokenizer (refused otherwise)."""
    packing: Strategy = "concat"
    """How documents fill rows: concat (documents cut into pieces at every train_len tokens, the token stream of
    pieces cut into rows, no padding), best_fit (whole pieces packed by best-fit decreasing within each shuffle
    block, the rest of a row padding; Ding et al. 2024), padded (one piece per row, padded) or stream (the document
    stream cut into rows, documents cut only where rows end, as TinyLlama's loader cuts them; no padding). See
    posfreq.train.data.packing_strategies."""
    length_upsample: dict[str, float] = field(default_factory=dict)
    """Expected copies per epoch of a document by its length in tokens (EOS included), e.g. {0-1024: 0.5, 4096-: 2.0}
    (Fu et al. 2024): LO-HI is LO <= length < HI, LO- has no end; weight w gives floor(w) copies plus one more with
    probability w - floor(w), drawn each epoch; other lengths keep 1; {}: every document once (train/data/upsample.py)."""
    attention: Literal["document", "row"] = "document"
    """Attend within each document only (document) or across the whole row (row; packing concat or stream, which
    are then the same)."""
    shuffle: bool = True
    """Shuffle documents each epoch (deterministic for the seed)."""
    shuffle_block: int = 1 << 20
    """Documents per shuffle block: bounds the sampler's memory on huge corpora, and is best_fit's packing buffer."""
    val_dir: Optional[str] = None
    """Token shards of held-out documents for the validation loss (`posfreq prepare --val-fraction` writes them
    beside the training shards, in OUT/val); null: no validation."""
    val_every_tokens: int = 0
    """Compute the validation loss every this many training tokens and at the end; 0: only at the end."""
    val_rows: int = 64
    """Rows per validation: the same rows every time, so the values compare across steps."""
    val_len: Optional[int] = None
    """Tokens per validation row; null: train_len. Runs of several training lengths validated at one val_len score
    the same tokens at every distance, so their loss by distance compares at equal distance. Distances from
    train_len on are ones the run never trained; they count in its val_loss too."""

    def __post_init__(self) -> None:
        _at_least("data.", self, 2, "train_len")  # a 1-token row has no target
        if self.train_len > MAX_TRAIN_LEN:
            raise ValueError(
                f"data.train_len {self.train_len:,} is beyond the longest training length posfreq plans "
                f"({MAX_TRAIN_LEN:,} tokens). Fix: a data.train_len up to that"
            )
        _at_least("data.", self, 1, "shuffle_block", "val_rows")
        _at_least("data.", self, 2, "val_len")
        _at_least("data.", self, 0, "val_every_tokens")
        if self.attention == "row" and self.packing not in TOKEN_STREAMS:
            raise ConfigError(
                f"data.attention=row needs data.packing=concat, not {self.packing!r} (padding must stay "
                "its own attention segment)"
            )
        try:
            upsample = LengthUpsample.parse(self.length_upsample, where="data.length_upsample")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if upsample.sources:
            raise ConfigError(
                f"data.length_upsample: per-source keys ({list(upsample.sources)}) need per-document "
                "sources, which token shards do not record; use LO-HI keys"
            )

    def row_packing(self) -> RowPacking:
        """How this section packs documents into rows, as the sampler and the schedule take it."""
        return RowPacking(
            self.packing, self.attention, self.shuffle, self.shuffle_block, self.length_upsample
        )


@dataclass
class OptimSection:
    """AdamW with linear warmup then cosine decay (the paper's TinyLlama recipe)."""

    lr: float = 4e-4
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 4e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 2000
    """Optimizer steps of linear warmup from 0 to lr."""
    decay_steps: Optional[int] = None
    """The step at which the cosine reaches min_lr (default: the run's total steps)."""
    beta1: float = 0.9
    """AdamW beta1, in [0, 1)."""
    beta2: float = 0.95
    """AdamW beta2, in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    weight_decay_scope: Literal["all", "matrices"] = "all"
    """all: every parameter decays (TinyLlama's recipe); matrices: only 2-D weights other than the embedding."""
    grad_clip: float = 1.0
    """Maximum global L2 norm of the gradient; 0 disables clipping."""

    def __post_init__(self) -> None:
        _at_least(
            "optim.", self, 0, "lr", "min_lr", "warmup_steps", "eps", "weight_decay", "grad_clip"
        )
        _at_least("optim.", self, 1, "decay_steps")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(
                    f"optim.{name}={getattr(self, name)!r} is out of range: it must be in [0, 1)"
                )


@dataclass
class CheckpointSection:
    """Milestones every N tokens (kept) and a rolling `latest` for resuming."""

    every_tokens: int = 10_000_000_000
    """A milestone checkpoint every this many tokens (the paper: every 10B)."""
    latest_every_steps: int = 500
    """Save the rolling `latest` checkpoint every this many steps; 0 disables the step trigger."""
    latest_every_minutes: float = 30.0
    """Save `latest` at least this often in wall-clock minutes; 0 disables the time trigger."""
    milestone_weights_only: bool = False
    """Milestones keep model weights only (smaller, not resumable)."""
    keep_full: Optional[int] = None
    """The newest N milestones keep the full resumable state (weights, optimizer, sampler), older ones only the
    weights, to save disk; null keeps all."""
    sharded: bool = True
    """Save with torch.distributed.checkpoint, one shard per rank; false: one full file."""

    def __post_init__(self) -> None:
        _at_least("checkpoint.", self, 1, "every_tokens", "keep_full")
        _at_least("checkpoint.", self, 0, "latest_every_steps", "latest_every_minutes")


@dataclass
class LoggingSection:
    """Where metrics go: OUT/metrics.jsonl and the log always, plus an optional logger."""

    logger: Literal["none", "csv", "wandb"] = "none"
    """An extra metrics logger: none, csv (OUT/csv) or wandb (offline without credentials)."""
    project: str = "posfreq"
    """The wandb project."""
    run_name: Optional[str] = None
    """The wandb run name (default: wandb's)."""
    every_steps: int = 1
    """Log a line of metrics every this many optimizer steps."""
    progress_bar: bool = True
    """Show a progress bar when stdout is a terminal (cluster logs always get plain timestamped lines)."""
    peak_flops_per_device: Optional[float] = None
    """Peak FLOP/s of one device for MFU (default: the known bf16 peak of the GPU; none on CPU)."""

    def __post_init__(self) -> None:
        _at_least("logging.", self, 1, "every_steps")


@dataclass
class TrainConfig:
    """A whole pretraining run."""

    out: str = "runs/pretrain"
    """The run directory: checkpoints/, metrics.jsonl (and csv/ or wandb/ with those loggers)."""
    seed: int = 0
    """Seed of the data order and the model initialisation."""
    total_tokens: int = 1_000_000_000_000
    """Train until this many tokens have been seen."""
    global_batch_tokens: int = 4_194_304
    """Tokens per optimizer step over all ranks and micro-batches (the paper: 4M)."""
    micro_batch_rows: int = 8
    """Rows of train_len tokens per rank per forward/backward."""
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks cuda when a GPU is present."""
    devices: Union[int, str] = "auto"
    """Processes per node: auto means every GPU, or 1 on CPU."""
    num_nodes: int = 1
    """Nodes (under SLURM, the job's node count)."""
    fsdp: Literal["auto", "full", "hybrid"] = "auto"
    """How FSDP2 spreads the model: full shards weights, gradients and optimizer state over every process; hybrid
    (HSDP) shards them within each node and replicates them across nodes, so parameter all-gathers and gradient
    reduce-scatters stay inside a node and only a gradient all-reduce per step crosses nodes, for num_nodes times
    the sharded state per GPU; auto: hybrid when num_nodes > 1, else full (one node: the two are the same)."""
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed"
    """bf16-mixed: bf16 compute with fp32 weights and gradient reduction; 32-true: fp32 throughout."""
    resume: Optional[str] = None
    """null: start fresh; auto: the newest complete checkpoint in OUT (else start); or a checkpoint directory."""
    overwrite: bool = False
    """With resume null, start afresh in an OUT that holds a run: the trainer's own files there (checkpoints/,
    metrics.jsonl, csv/; a new wandb run id) are replaced, nothing else. Without it such an OUT is refused."""
    stop_at_step: Optional[int] = None
    """End this invocation after this step, saving `latest` (for jobs and tests)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """On a non-finite loss or gradient norm: stop, or skip that step."""
    requeue_on_signal: bool = True
    """On SIGUSR1 under SLURM: save latest, `scontrol requeue`, exit."""
    memory_check: bool = True
    """On GPUs, before the first step: refuse a run whose planned memory per GPU (train/run/memory.py; calibrated
    under model.compile) exceeds the GPU's free memory less a margin, naming the micro-batch or config that fits."""
    resume_override: dict[str, Scalar] = field(default_factory=dict)
    """Schedule keys set and allowed to differ from the checkpoint on resume, e.g. {optim.lr: 1e-4}."""
    model: ModelSection = field(default_factory=ModelSection)
    """The model."""
    data: DataSection = field(default_factory=DataSection)
    """The token shards and their packing."""
    optim: OptimSection = field(default_factory=OptimSection)
    """The optimizer and its schedule."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoint cadence and retention."""
    logging: LoggingSection = field(default_factory=LoggingSection)
    """Logs and metrics."""

    def __post_init__(self) -> None:
        self.total_tokens = _number(self.total_tokens, int, "total_tokens")
        self._apply_resume_override()
        _at_least(
            "",
            self,
            1,
            "total_tokens",
            "global_batch_tokens",
            "micro_batch_rows",
            "num_nodes",
            "stop_at_step",
        )
        for name in ("total_tokens", "global_batch_tokens"):
            if (
                getattr(self, name) > MAX_TOKENS
            ):  # counts, logs and the plan's days hold them exactly below
                raise ConfigError(
                    f"{name}={getattr(self, name):,} is out of range: it must be at most 2^53 "
                    f"({MAX_TOKENS:,} tokens)"
                )
        if not (self.devices == "auto" or (isinstance(self.devices, int) and self.devices >= 1)):
            raise ConfigError(
                f"devices={self.devices!r} is out of range: it must be 'auto' or an integer >= 1"
            )

    def _apply_resume_override(self) -> None:
        """Check `resume_override` (only RESUME_OVERRIDABLE keys) and set each key it names to its value."""
        other = sorted(set(self.resume_override) - set(RESUME_OVERRIDABLE))
        if other:
            raise ConfigError(
                f"resume_override: {other} cannot change on resume; only {list(RESUME_OVERRIDABLE)} "
                "can (the rest would change the model, the data stream or the optimizer)"
            )
        for key, value in list(self.resume_override.items()):
            *section, name = key.split(".")
            target = getattr(self, section[0]) if section else self
            value = _number(value, type(getattr(target, name)), f"resume_override.{key}")
            self.resume_override[key] = value
            setattr(target, name, value)
            if section:
                target.__post_init__()  # the section's range checks, on the new value

    def fsdp_mesh_shape(self, devices_per_node: int) -> tuple[int, int]:
        """(replicas, shards) of FSDP2's device mesh over num_nodes x `devices_per_node` processes: one replica
        sharded over all of them (full), or one per node sharded within it (hybrid)."""
        world = self.num_nodes * devices_per_node
        hybrid = self.fsdp == "hybrid" or (self.fsdp == "auto" and self.num_nodes > 1)
        return (self.num_nodes, devices_per_node) if hybrid else (1, world)

    def to_dict(self) -> dict:
        return asdict(self)


def build_parser() -> ArgumentParser:
    """`posfreq pretrain`'s parser: --config FILE.yaml plus one flag per TrainConfig field."""
    parser = command_parser(
        "posfreq pretrain",
        "Pretrain a TinyLlama-style model (Lightning Fabric + FSDP2). "
        "Options come from a YAML --config and flags (flags win).",
        config_file=True,
    )
    parser.add_class_arguments(TrainConfig, nested_key=None, as_group=False)
    return parser


def _build(parser: ArgumentParser, namespace: Namespace) -> TrainConfig:
    """TrainConfig from a parsed namespace (sections instantiated, then the run keys)."""
    values = parser.instantiate(namespace)
    return TrainConfig(**{f.name: values[f.name] for f in fields(TrainConfig)})


def config_from_dict(data: dict, where: str = "config") -> TrainConfig:
    """Build a TrainConfig from a nested dict; unknown keys, wrong types and out-of-range values are ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of config keys, got {type(data).__name__}")
    try:
        refuse_code(data, where)
    except CodeInConfig as err:
        raise ConfigError(str(err)) from None
    parser = build_parser()
    parser.exit_on_error = False
    try:
        return _build(parser, parser.parse_object(data))
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except (
        Exception
    ) as err:  # jsonargparse's ArgumentError / ValueError: an unknown key or a wrong type
        raise ConfigError(f"{where}: {err}") from None


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The run config from `--config FILE` and command-line flags (exits with a usage error on a bad flag)."""
    parser = build_parser()
    namespace = parse(parser, argv)
    where = " + ".join(
        [str(path) for path in namespace.get("config") or []] + ["command-line overrides"]
    )
    try:
        return _build(parser, namespace)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
