"""What `posfreq ruler` runs: one dataclass, from which the command builds its flags and which `posfreq table`
builds for its Table 2 rows, so both share one definition of every RULER setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from posfreq.train.positions.names import SCHEMES

SchemeName = Literal[SCHEMES]


@dataclass(frozen=True)
class RulerSettings:
    """One RULER evaluation: the model, its position scheme, the tasks and lengths, how it runs, where it writes."""

    model: str
    """hf:DIR, a local transformers model."""
    positions: SchemeName = "rope"
    """The position scheme (posfreq.train.positions.schemes)."""
    position_options: dict[str, Union[bool, int, float, str, None]] = field(default_factory=dict)
    """The scheme's options as JSON, e.g. '{"window": 512, "protocol": "paper"}' (docs/string.md)."""
    shift: Optional[int] = None
    """STRING's S (null: L // 3)."""
    window: Optional[int] = None
    """STRING's W (null: min(128, S // 2)), or the window of rerope and self_extend."""
    train_len: Optional[int] = None
    """The training length L: STRING's defaults and the default length (null: the config's
    max_position_embeddings)."""
    lengths: Optional[str] = None
    """Prompt lengths, a comma list or START:STOP:STEP (STOP included); null: L."""
    tasks: str = "all"
    """A comma list of RULER's tasks (analysis/ruler_task/runner.py's TASKS), or all."""
    samples: int = 500
    """Samples per task and length (RULER: 500)."""
    chat_template: bool = False
    """Frame each prompt with the tokenizer's chat template (instruct models)."""
    batch_size: int = 1
    """Prompts generated together."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:1, ..."""
    threads: int = 0
    """CPU threads for torch (0: torch's default)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 on CUDA, float32 on a CPU."""
    out: Optional[str] = None
    """The output folder (null: runs/ruler/<model>-<positions>)."""
    log_samples: bool = False
    """Also write every prompt and answer."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(
                f"--samples {self.samples}: each task needs at least one sample per length. Fix: --samples 500 "
                "(RULER's), or any number >= 1"
            )
        if self.positions not in SCHEMES:
            raise ValueError(f"--positions {self.positions}: choose one of {', '.join(SCHEMES)}")
