"""Loss figures: the training and validation loss of runs from their metrics.jsonl, and the loss by distance
(train/run/loss_by_distance.py), one curve per model or milestone, on a log distance axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posfreq.analysis.plots.frequency import plt, save_figure


def plot_loss_by_distance(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], stem: str | Path, title: str = ""
) -> list[Path]:
    """Mean loss (y) per distance bucket (x: its first distance + 1, log2), a line per label; `curves[label]` is
    (edges, mean loss per bucket), empty buckets (NaN) left out."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (edges, mean) in curves.items():
        held = ~np.isnan(mean)
        ax.plot(np.asarray(edges[:-1])[held] + 1, np.asarray(mean)[held], marker=".", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance from the document's first token + 1 (tokens)")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title(title or "Loss by distance")
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    return save_figure(fig, stem)


def plot_loss_curves(runs: dict[str, list[dict]], stem: str | Path) -> list[Path]:
    """Training loss (lines: a running mean over 2% of each run's steps, so runs stay apart) and validation loss
    (dots) against the tokens each run trained, one colour per run; `runs[label]` holds its metrics.jsonl rows
    (train/run/log.py)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, rows in runs.items():
        train = [
            (r["tokens"], r["loss"]) for r in rows if r.get("loss") is not None and "tokens" in r
        ]
        val = [(r["tokens"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if train:
            tokens, loss = (np.asarray(v, dtype=float) for v in zip(*train))
            window = max(1, len(loss) // 50)
            mean = np.convolve(loss, np.ones(window) / window, mode="valid")
            (line,) = ax.plot(tokens[window - 1 :], mean, lw=1.2, label=label)
            if val:
                ax.plot(*zip(*val), "o", ms=4, color=line.get_color())
    ax.set_xlabel("tokens trained by the run")
    ax.set_ylabel("loss (nats; line: running mean; dots: validation)")
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, stem)


def plot_loss_vs_frequency(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], stem: str | Path
) -> list[Path]:
    """Mean loss at distance i (y) against the number of times the run trained distance i, f(i) (x, log10): the
    continuous analogue of Fig. 2b. If f alone decides how well a distance is used, the curves of different
    training lengths coincide. `curves[label]` is (f at each bucket's first distance, mean loss per bucket)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (f, mean) in curves.items():
        held = ~np.isnan(mean) & (np.asarray(f) > 0)
        ax.plot(np.asarray(f)[held], np.asarray(mean)[held], marker=".", lw=0.8, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("f(i): times distance i was trained (Eq. 2)")
    ax.set_ylabel("mean loss at distance i (nats)")
    ax.set_title("Loss by distance against position frequency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, stem)
