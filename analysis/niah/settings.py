"""The probe's settings: what decides a probe's answers (its result key: analysis/keys.py).

Also the probe's error type: library code raises `ProbeError`; only the CLI turns it into one line.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional, Union, get_args

from posfreq.analysis.niah.needles import ANSWER_BUDGET
from posfreq.train.positions.names import SCHEMES

Precision = Literal["auto", "float32", "bfloat16", "bfloat16-prefill"]
BosPolicy = Literal["auto", "always", "never"]
AnswerOrder = Literal["document", "nearest_first", "alone"]
Engine = Literal["posfreq", "transformers"]
SchemeName = Literal[SCHEMES]  # the position schemes of posfreq.train.positions.schemes
PRECISIONS: tuple[str, ...] = get_args(Precision)
BOS_POLICIES: tuple[str, ...] = get_args(BosPolicy)
ANSWER_ORDERS: tuple[str, ...] = get_args(AnswerOrder)
ENGINES: tuple[str, ...] = get_args(Engine)


PROBE_BATCH_SIZE = 8
"""--batch-size: the most prompts decoded together."""
CPU_BATCH_TOKENS = 8192
"""--batch-tokens auto on a CPU: the most test tokens decoded together."""
CPU_PREFILL_TOKENS = 2048
"""--prefill-tokens auto on a CPU: the most prompt tokens in one forward (train.model.transformer.row_groups)."""


class ProbeError(ValueError):
    """A probe that cannot run as asked (missing model, refused lengths, stale results); the message says the fix."""


@dataclass(frozen=True)
class ProbeSettings:
    """What decides the probe's answers (hashed into the result key, with the model and the prompts)."""

    tests_per_length: int = 500
    """NIAH tests per length (the paper: 500). Tests 0..n-1, the same in a probe of any size: asking for more
    than a directory holds probes only the rest, and asking for fewer reads the first ones."""
    seed: int = 0
    """Test seed: the same seed builds the same tests (needles, depths, haystack windows) anywhere."""
    haystack: str = "pg"
    """The haystack: pg (Paul Graham essays), noise, or a .txt file or a directory of them."""
    max_new_tokens: int = ANSWER_BUDGET
    """The answer budget B: a test of length n is a prompt of n - B tokens and at most B generated ones
    (the official script's 128), so no token is generated at a position >= n."""
    positions: SchemeName = "rope"
    """The position scheme the model decodes with (posfreq.train.positions.schemes)."""
    position_options: dict[str, Union[bool, int, float, str, None]] = field(default_factory=dict)
    """Options of the position scheme, e.g. {shift: 1365} (or --position-options.shift 1365)."""
    precision: Precision = "auto"
    """auto: bf16 autocast on GPU and float32 on CPU (resolved before results are keyed); float32; bfloat16
    (autocast over float32 weights); or bfloat16-prefill (the prompt's forward and the teacher-forced pass under
    bf16 autocast, the KV cache and the decoding steps in float32: the fastest on a CPU with bf16 units, see
    docs/performance.md)."""
    tokenizer: Optional[str] = None
    """The tokenizer spec (llama3, bytes, hf:DIR) instead of the model's own (null: the model's own)."""
    bos: BosPolicy = "auto"
    """Prepend BOS: auto follows how the model saw text in training (ours: as the trainer's shards, no BOS;
    Hugging Face: its tokenizer's convention; with chat_template: only what the template renders)."""
    chat_template: bool = False
    """Frame each prompt with the tokenizer's chat template (one user turn; the answer prefix opens the
    assistant's turn)."""
    teacher_forced: bool = True
    """Also score each needle under teacher forcing (its log-probability and token accuracy, one extra forward
    pass per batch)."""
    greedy: bool = True
    """Decode each answer greedily (the paper's score). False: teacher-forced scores only, one forward per test
    and no decoding, for a cheap paired measure (its tables then score with Analysis.scoring teacher_forced)."""
    answer_order: AnswerOrder = "document"
    """Needle order of the teacher-forced reference answer: as in the document, nearest the question first, or alone
    (each needle as the whole answer on its own, scored on its tokens after the fewest that tell it from the other
    needles, so that naming order cannot matter: one prefill of the prompt shared by the four answers)."""
    engine: Engine = "posfreq"
    """What runs the model: posfreq (its own model; our checkpoints and Llama-family HF models) or
    transformers (any architecture transformers loads, --model hf:DIR only; rope, or another scheme on
    the model types it is checked on: train/positions/hf_rows.py)."""

    def __post_init__(self) -> None:
        if min(self.tests_per_length, self.max_new_tokens) < 1:
            raise ValueError(
                f"tests_per_length and max_new_tokens must be >= 1, got {self.tests_per_length} "
                f"and {self.max_new_tokens}"
            )
        for name, allowed in (
            ("positions", SCHEMES),
            ("precision", PRECISIONS),
            ("bos", BOS_POLICIES),
            ("answer_order", ANSWER_ORDERS),
            ("engine", ENGINES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not (self.greedy or self.teacher_forced):
            raise ValueError(
                "greedy false and teacher_forced false leave nothing to measure; "
                "Fix: keep --teacher-forced true with --greedy false"
            )
        if self.engine == "transformers" and self.precision == "bfloat16-prefill":
            raise ValueError(
                "--engine transformers keeps one dtype from prefill to decoding; "
                "Fix: use --precision float32 or bfloat16"
            )

    def decoding(self) -> dict:
        """The settings that change answers given the prompts (names of files excluded: content is keyed apart).
        Not the number of tests: test i is the same in a probe of any size, so more tests extend fewer."""
        keep = (
            "seed",
            "max_new_tokens",
            "positions",
            "position_options",
            "precision",
            "teacher_forced",
            "answer_order",
        )
        decoding = {k: v for k, v in asdict(self).items() if k in keep}
        if self.engine != "posfreq":  # keys of the default engine stay as they were
            decoding["engine"] = self.engine
        if not self.greedy:  # likewise the keys of probes that decode
            decoding["greedy"] = False
        return decoding


MAX_PROBE_LENGTH = 1 << 22
"""The longest test the probe builds (tokens): a prompt of this length already needs gigabytes of KV cache on a
small model; a larger one is refused before any test is built."""

MAX_PROBE_LENGTHS = 4096
"""The most test lengths one probe takes (a START:STOP:STEP range is counted before it is built)."""


def parse_lengths(spec: str) -> list[int]:
    """'START:STOP:STEP' (STOP included) or a comma list '128,256,512' -> sorted unique lengths, each at most
    MAX_PROBE_LENGTH, at most MAX_PROBE_LENGTHS of them (checked before any list is built)."""
    try:
        if ":" in spec:
            start, stop, step = (int(x) for x in spec.split(":"))
            if step < 1:
                raise ValueError
            count = max(0, (stop - start) // step + 1)
            if count > MAX_PROBE_LENGTHS:
                raise argparse.ArgumentTypeError(
                    f"--lengths {spec} asks for {count:,} lengths, more than a probe takes ({MAX_PROBE_LENGTHS:,}). "
                    "Fix: a larger STEP or a shorter range"
                )
            lengths = list(range(start, stop + 1, step))
        else:
            lengths = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths expects START:STOP:STEP or a comma list, got {spec!r}"
        ) from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths {spec!r} gives no positive lengths")
    if max(lengths) > MAX_PROBE_LENGTH:
        raise argparse.ArgumentTypeError(
            f"--lengths: {max(lengths):,} tokens is beyond the longest test the probe builds ({MAX_PROBE_LENGTH:,}). "
            "Fix: shorter lengths"
        )
    return sorted(set(lengths))
