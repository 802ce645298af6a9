"""What a run config implies before any data is read: the model config and the batch geometry of a step.

One owner for the arithmetic the trainer (train/run/resolved.py) and the job planner
(train/preflight/plan.py) both need, so the plan's accumulation and step count are the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from posfreq.train.model.config import ModelConfig, model_preset
from posfreq.train.run.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class BatchGeometry:
    """How one optimizer step of `global_batch_tokens` splits over ranks and micro-batches."""

    global_rows: int
    """Rows of train_len tokens in one optimizer step, over all ranks."""
    accumulation: int
    """Micro-batches of micro_batch_rows rows each rank accumulates per step."""
    total_steps: int
    """Optimizer steps to reach total_tokens (the last one may pass it)."""


def batch_geometry(cfg: TrainConfig, world_size: int) -> BatchGeometry:
    """The step's rows, accumulation and step count; ConfigError if a step is not whole micro-batches."""
    L = cfg.data.train_len
    rows_per_micro = cfg.micro_batch_rows * world_size
    if cfg.global_batch_tokens % L or (cfg.global_batch_tokens // L) % rows_per_micro:
        raise ConfigError(
            f"global_batch_tokens={cfg.global_batch_tokens} is not a whole number of micro-batches of "
            f"micro_batch_rows={cfg.micro_batch_rows} x train_len={L} x world_size={world_size} = "
            f"{rows_per_micro * L} tokens. Fix: make global_batch_tokens a multiple of {rows_per_micro * L}."
        )
    global_rows = cfg.global_batch_tokens // L
    return BatchGeometry(
        global_rows=global_rows,
        accumulation=global_rows // rows_per_micro,
        total_steps=-(-cfg.total_tokens // cfg.global_batch_tokens),
    )


def resolve_model_config(cfg: TrainConfig, vocab_size: int | None = None) -> ModelConfig:
    """The preset with the config's overrides and train_len; `vocab_size` (the data's) unless overridden.

    The checkpoint records the length it was trained at: STRING and the baselines derive their
    defaults (e.g. S = L/3) from it at inference.
    """
    overrides = dict(cfg.model.overrides)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    overrides["train_len"] = cfg.data.train_len
    try:
        return model_preset(cfg.model.preset, **overrides)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from err
