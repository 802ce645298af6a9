"""Re-deriving a run's tables from its stored probe records under other analysis options (threshold, criterion,
...), into new folders under --out: every check made before anything is written, never over the source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from posfreq.analysis.niah import store
from posfreq.analysis.tables.pass_curve import Analysis
from posfreq.train.journal import is_record
from posfreq.train.outdir import owner_of

COMMAND = "effective-length"
FIGURES = (*store.RUN_FIGURES, "fig3_position_frequency")


class RederiveError(ValueError):
    """A re-derivation that cannot be made as asked; the message names the folder and the fix."""


@dataclass
class Rederivation:
    """One results folder re-derived under `analysis`: its records read at `source`, its tables written to
    `dest` inside --out."""

    source: Path
    dest: Path
    analysis: Analysis
    run: bool
    """A run's results (a folder per checkpoint, then the run tables) rather than one model's."""


def plan_rederivations(sources: Sequence[Path], out: Path, options: dict) -> list[Rederivation]:
    """Where and how each results folder is re-derived, every check made before anything is written: a folder
    of records (not an earlier re-derivation), an analysis the options make valid, one destination per folder,
    none of them over its source."""
    plans = []
    for source in sources:
        meta = _source_meta(source)
        stored = meta.get("analysis") if isinstance(meta.get("analysis"), dict) else {}
        try:
            analysis = Analysis(**{**stored, **options})
        except (TypeError, ValueError) as err:
            raise RederiveError(f"{source / store.META_FILE}: {err}") from None
        dest = out / derived_name(source)
        plans.append(Rederivation(source, dest, analysis, "checkpoints" in meta))
    _check_destinations(plans)
    return plans


def _source_meta(source: Path) -> dict:
    """The probe.json of a results folder holding the probe's records; RederiveError for an earlier
    re-derivation (tables only, nothing to re-derive from)."""
    meta = store.read_json(source / store.META_FILE)
    if owner_of(source) == COMMAND or store.DERIVED_FROM in meta:
        origin = meta.get(store.DERIVED_FROM, "the probe's results folder")
        raise RederiveError(
            f"{source} is a re-derivation by `posfreq {COMMAND}` (tables only, no per-test records). "
            f"Fix: re-derive from {origin}"
        )
    return meta


def derived_name(source: Path) -> Path:
    """The folder inside --out that `source`'s re-derived tables go to: RUN/probe for RUN/probe (so that
    `posfreq compare OUT/RUN` finds them as it finds RUN/probe)."""
    source = source.resolve()
    return Path(source.parent.name, source.name) if source.parent.name else Path(source.name)


def _check_destinations(plans: Sequence[Rederivation]) -> None:
    """RederiveError when two folders would share a destination or one would be written over its source."""
    seen: dict[Path, Path] = {}
    for plan in plans:
        dest, source = plan.dest.resolve(), plan.source.resolve()
        if dest in seen:
            raise RederiveError(
                f"{seen[dest]} and {plan.source} would both be re-derived into {plan.dest}. Fix: re-derive "
                "them with separate --out folders (nothing was changed)"
            )
        seen[dest] = plan.source
        if dest == source or source in dest.parents or dest in source.parents:
            raise RederiveError(
                f"--out: the tables re-derived from {plan.source} would go to {plan.dest}, over its own "
                "folder. Fix: pass an --out outside the probe's results (nothing was changed)"
            )


def earlier_figures(out: Path) -> bool:
    """Whether an older effective-length (before owner records) wrote `out`: Fig. 2a and 2b, and nothing but
    the figures it draws, by name. A folder holding any other file, figure or not, is a user's."""
    names = {entry.name for entry in out.iterdir() if not is_record(entry.name)}
    always, drawn = store.figure_names(store.RUN_FIGURES), store.figure_names(FIGURES)
    regular = all((out / name).is_file() and not (out / name).is_symlink() for name in names)
    return regular and always <= names <= drawn
