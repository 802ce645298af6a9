"""What a pretraining run reports, on rank 0: metrics.jsonl, the console and an end-of-run summary.

The console gets a tqdm bar only when stdout is a terminal; otherwise (a SLURM job's .out file)
it gets one plain, timestamped line through Python `logging` every `logging.every_steps` steps:

    2026-11-23 02:31:07 step 120/5000 tokens 503.3M loss 3.4120 lr 3.00e-04 grad_norm 0.870 tok/s 12.3k mfu 41.2% eta 2h13m

(`key value` pairs, so `grep step | awk` or `parse_line` reads them back). Every row of
OUT/metrics.jsonl carries a `time` (UTC, ISO 8601); validation rows carry `val_loss`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from posfreq.train.atomic import write_text_atomic
from posfreq.train.journal import open_recorded

LOG = logging.getLogger("posfreq.train")


def console_handler(stream: IO[str]) -> logging.Handler:
    """A handler writing `YYYY-MM-DD HH:MM:SS message` lines (UTC) to `stream`."""
    handler = logging.StreamHandler(stream)
    formatter = logging.Formatter("%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    return handler


def start_console(active: bool, stream: IO[str] | None = None) -> None:
    """Route the `posfreq.train` logger to `stream` (default: the current stdout) on rank 0; silence it elsewhere."""
    LOG.propagate = False
    LOG.handlers[:] = [console_handler(stream or sys.stdout)] if active else [logging.NullHandler()]
    LOG.setLevel(logging.INFO)


def human(number: float) -> str:
    """503300000 -> '503.3M' (k, M, B, T), for tokens and rates in log lines."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(number) >= size:
            return f"{number / size:.1f}{unit}"
    return f"{number:.0f}"


def duration(seconds: float) -> str:
    """7980 -> '2h13m'; 75 -> '1m15s'."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return (
        f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    )


def step_line(row: dict, total_steps: int, eta_s: float | None) -> str:
    """One step's console line (without the timestamp)."""
    parts = [
        f"step {row['step']}/{total_steps}",
        f"tokens {human(row['tokens'])}",
        f"loss {row['loss']:.4f}",
        f"lr {row['lr']:.2e}",
        f"grad_norm {row['grad_norm']:.3f}",
        f"tok/s {human(row['tokens_per_s'])}",
    ]
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:.1f}%")
    if row.get("skipped"):
        parts.append(f"skipped {row.get('skip_reason') or 'non_finite'}")
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s)}")
    return " ".join(parts)


def parse_line(line: str) -> dict[str, str]:
    """A console line back into {'time': ..., 'step': '120/5000', 'loss': '3.4120', ...} (key value pairs)."""
    date, clock, *words = line.split()
    out = {"time": f"{date} {clock}"}
    for key, value in zip(words[::2], words[1::2]):
        out[key] = value
    return out


def split_metrics(text: str, resumed_step: int) -> tuple[list[str], list[str]]:
    """(JSON rows of metrics.jsonl up to `resumed_step`, lines that are not JSON rows, e.g. one torn by a kill)."""
    keep, unreadable = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            unreadable.append(line)
        elif row.get("step", 0) <= resumed_step:
            keep.append(line)
    return keep, unreadable


@dataclass
class Totals:
    """What this invocation did, for the end-of-run summary."""

    first_step: int
    steps: int = 0
    skipped: int = 0
    seconds: float = 0.0
    tokens: int = 0
    mfu_seconds: float = 0.0  # sum of mfu x step time, for a time-weighted mean
    last: dict = field(default_factory=dict)
    last_val: dict = field(default_factory=dict)


class RunLog:
    """Rank 0's record of a run: OUT/metrics.jsonl, the Fabric loggers (csv / wandb) and the console.

    Other ranks get an inactive RunLog (every method a no-op), so the loop calls it unconditionally.
    """

    def __init__(
        self,
        out: Path,
        resumed_step: int,
        total_steps: int,
        every_steps: int,
        active: bool,
        progress_bar: bool,
        stream: IO[str] | None = None,
    ) -> None:
        self.active, self.total_steps, self.every = active, total_steps, every_steps
        self.totals = Totals(first_step=resumed_step)
        self.file = self.bar = None
        if not active:
            return
        if progress_bar and (stream or sys.stdout).isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=resumed_step,
                unit="step",
                dynamic_ncols=True,
                desc="pretrain",
            )
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        if path.exists():  # drop lines a crashed run wrote after the checkpoint we resume from
            keep, unreadable = split_metrics(path.read_text(errors="replace"), resumed_step)
            if unreadable:
                aside = path.with_name(path.name + ".unreadable")
                with open_recorded(aside, "a") as f:
                    f.write("".join(line + "\n" for line in unreadable))
                LOG.warning(
                    "%s: moved %d line(s) that are not JSON rows to %s (a run killed mid-write leaves a "
                    "torn last line)",
                    path,
                    len(unreadable),
                    aside,
                )
            write_text_atomic(path, "".join(line + "\n" for line in keep))
        self.file = open_recorded(path, "a")

    def info(self, message: str) -> None:
        """A plain timestamped line (start-up facts, checkpoints, signals), above the bar on a terminal."""
        if self.active:
            if self.bar is not None:
                self.bar.clear()
            LOG.info(message)
            if self.bar is not None:
                self.bar.refresh()

    def _record(self, row: dict, fabric: Any) -> None:
        row = {**row, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        fabric.log_dict(
            {
                k: v
                for k, v in row.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
            },
            step=row["step"],
        )

    def step(self, row: dict, fabric: Any, last: bool = False) -> None:
        """One optimizer step: counted always; written and printed every `every_steps` steps, at the run's last step
        and at `last`, this invocation's last step (stop_at_step, a signal), so no job ends on an unlogged step."""
        if not self.active:
            return
        t = self.totals
        t.steps, t.skipped, t.seconds = (
            t.steps + 1,
            t.skipped + bool(row["skipped"]),
            t.seconds + row["step_time_s"],
        )
        t.tokens = row["tokens"]
        t.mfu_seconds += (row["mfu"] or 0.0) * row["step_time_s"]
        t.last = row
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", refresh=False)
        if row["step"] % self.every and row["step"] != self.total_steps and not last:
            return
        self._record(row, fabric)
        if self.bar is None:
            eta = (self.total_steps - row["step"]) * t.seconds / t.steps
            LOG.info(step_line(row, self.total_steps, eta))

    def validation(
        self, step: int, tokens: int, val_loss: float, targets: int, fabric: Any
    ) -> None:
        """A validation loss over `targets` held-out tokens at this step."""
        if not self.active:
            return
        self.totals.last_val = {"step": step, "val_loss": val_loss}
        self._record(
            {"step": step, "tokens": tokens, "val_loss": val_loss, "val_targets": targets}, fabric
        )
        self.info(
            f"validation step {step} tokens {human(tokens)} val_loss {val_loss:.4f} "
            f"val_ppl {math.exp(min(val_loss, 50)):.2f} val_targets {targets}"
        )

    def summary(self, why: str, checkpoints: list[str]) -> str:
        """The end-of-run summary line (printed too), in `key value` pairs like a step line: why it ended (one
        word: finished, signal, stop_at_step, nothing_left), steps, tokens, loss, wall time, speed, checkpoints."""
        t = self.totals
        parts = [f"summary {why}"]
        if t.steps:
            rate = (
                t.steps * (t.last["tokens"] / t.last["step"]) / t.seconds
            )  # every step has the same tokens
            parts += [
                f"steps {t.first_step + 1}-{t.last['step']}/{self.total_steps}",
                f"tokens {human(t.tokens)}",
                f"loss {t.last['loss']:.4f}",
                f"wall {duration(t.seconds)}",
                f"tok/s {human(rate)}",
            ]
            if t.mfu_seconds:
                parts.append(f"mfu {100 * t.mfu_seconds / t.seconds:.1f}%")
            if t.skipped:
                parts.append(f"skipped {t.skipped}")
            if t.last_val:
                parts.append(f"val_loss {t.last_val['val_loss']:.4f}")
        parts.append(f"checkpoints {','.join(dict.fromkeys(checkpoints)) or 'none'}")
        text = " ".join(parts)
        self.info(text)
        return text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
