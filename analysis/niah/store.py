"""The probe's result store: one directory per (model content, probe settings). The one module that knows its
file names; analysis/tables/derive.py derives the tables from it and analysis/plots/derived.py the figures.

Layout of a model's result directory (written by scripts/commands/probe.py):

    key.json                the result key and its parts (model fingerprint, prompts, settings, code)
    probe.json              provenance: settings, model, tokens seen, training length, lengths, analysis
    trained_lengths.npy     the checkpoint's trained-length histogram (a copy: results outlive checkpoints)
    tests/L000128.jsonl     one record per test: metadata, generated text, both scores, teacher-forced score
    tests/L000128.json      the length's completion marker (key, seconds, batch size, device)
    tests/L000128.partial.json  while a length is probed: its key, seconds and the records of the tests done so
                            far, rewritten after each batch, so a killed probe resumes at the batch it was in

and, derived from those under an `Analysis` (re-derivable at any time, nothing decoded again):
summary.csv, distance.csv, effective_length.csv, failure_by_thirds.csv/.md, figures/. A run's result directory
holds one such directory per checkpoint, named after it, and the run tables beside them.

A directory is the probe's own (train/outdir.py's owner record, or an older probe's key.json with only the
probe's files beside it) before anything is written there: a user's folder is refused untouched. A directory
belongs to one key. Results under another key (other weights, prompts, settings or code) are never reused: the
probe refuses to write there unless asked to replace them. A re-derivation under another `Analysis` may write
its tables to another directory (`dest`), never over the records' own.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Sequence

from posfreq.analysis.niah.record import ProbeRecord
from posfreq.train.atomic import write_json_atomic, write_text_atomic
from posfreq.train.json_file import finite_numbers, read_json_object
from posfreq.train.outdir import (
    check_output_dir,
    claim_output_dir,
    json_object_with,
    only_files,
    own_entry_names,
    owner_of,
)

KEY_FILE = "key.json"
META_FILE = "probe.json"
HIST_FILE = "trained_lengths.npy"
TESTS_DIR = "tests"
FIGURES_DIR = "figures"
RECORD_FILE = re.compile(r"L\d{6}(\.jsonl?|\.partial\.json)")
"""A length's per-test records, completion marker or partial records in OUT/tests (`length_files`,
`partial_file`)."""
MARKER_FILE = re.compile(r"L\d{6}\.json")
DERIVED_FROM = "derived_from"
"""probe.json's field naming the result directory whose records a re-derivation elsewhere read."""
PROBE = "probe"
"""The command recorded as the owner of the probe's result directories (train/outdir.py)."""
MODEL_FIGURES = ("niah_heatmap", "failure_by_thirds")
"""The figures of one model's results in OUT/figures (each as .png and .pdf; analysis/plots/derived.py)."""
RUN_FIGURES = ("fig2a_effective_length_vs_tokens", "fig2b_frequency_vs_effective_length")
"""The figures of a run's results in OUT/figures (analysis/plots/derived.py)."""


class StaleResults(RuntimeError):
    """A result directory holds results made by other weights, prompts, settings or code."""


def write_json(path: Path, data: dict) -> None:
    """Write a result file's JSON object atomically (values JSON does not know as strings)."""
    write_json_atomic(path, data, indent=1, default=str)


def read_json(path: Path) -> dict:
    """A JSON object from a result file, with an error naming the file when it is damaged."""
    return read_json_object(
        path, StaleResults, "Fix: delete it (or pass --replace-stale) to redo it"
    )


PROBE_META_KEYS = {"settings": dict, "checkpoints": dict, "lengths": list, "model": str}
"""probe.json's keys a re-derivation reads, with the type each must have."""


def read_meta(out: Path, *required: str) -> dict:
    """The probe.json of result directory `out` (`read_json`), StaleResults naming it unless each of `required`
    (keys of PROBE_META_KEYS) is there with its type, and settings holds tests_per_length when required."""
    path = out / META_FILE
    meta = read_json(path)
    for key in required:
        if not isinstance(meta.get(key), PROBE_META_KEYS[key]):
            raise StaleResults(
                f"{path}: no {key} ({PROBE_META_KEYS[key].__name__}), which the probe writes: not a probe's "
                "record of its results. Fix: restore it, or probe again into a new --out"
            )
    if "settings" in required and not isinstance(meta["settings"].get("tests_per_length"), int):
        raise StaleResults(
            f"{path}: settings.tests_per_length is missing or not a number. Fix: restore it, or probe "
            "again into a new --out"
        )
    return meta


def claim(out: Path, key: str, parts: dict, replace_stale: bool = False) -> None:
    """Make `out` the home of results under `key`, refusing (or clearing) results made under another key."""
    out.mkdir(parents=True, exist_ok=True)
    key_file = out / KEY_FILE
    if key_file.is_file():
        try:
            theirs = read_json(key_file)
        except StaleResults:
            theirs = {"key": None, "parts": {}}
        if theirs.get("key") == key:
            return
        differs = sorted(k for k in parts if theirs.get("parts", {}).get(k) != parts[k]) or [
            "unknown"
        ]
        reason = (
            f"{out} holds probe results with another key (they differ in: {', '.join(differs)})"
        )
    elif (out / TESTS_DIR).is_dir() and any((out / TESTS_DIR).iterdir()):
        foreign = sorted(
            p.name for p in (out / TESTS_DIR).iterdir() if not RECORD_FILE.fullmatch(p.name)
        )
        if foreign:
            raise StaleResults(
                f"{out}/tests holds files the probe did not write ({', '.join(foreign[:3])}). Fix: "
                "pass another --out (nothing was changed)"
            )
        reason = f"{out} holds probe results without a key (written by an older posfreq)"
    else:
        write_json(key_file, {"key": key, "parts": parts})
        return
    if not replace_stale:
        raise StaleResults(
            f"{reason}. They are never reused. Fix: pass another --out, or --replace-stale to "
            "delete them and probe again."
        )
    discard_records(out)
    write_json(key_file, {"key": key, "parts": parts})


SUMMARY_FILE = "summary.csv"
DISTANCE_FILE = "distance.csv"
EFFECTIVE_LENGTH_FILE = "effective_length.csv"
THIRDS_FILE = "failure_by_thirds.csv"
THIRDS_MARKDOWN = "failure_by_thirds.md"
DISTANCE_BY_CHECKPOINT_FILE = "distance_by_checkpoint.csv"
POSITION_FREQUENCY_FILE = "position_frequency.csv"
DERIVED_TABLES = (
    SUMMARY_FILE,
    DISTANCE_FILE,
    EFFECTIVE_LENGTH_FILE,
    THIRDS_FILE,
    THIRDS_MARKDOWN,
    DISTANCE_BY_CHECKPOINT_FILE,
    POSITION_FREQUENCY_FILE,
)
"""The tables derived into a result directory (analysis/tables/derive.py)."""


RUN_ENTRIES = frozenset(
    {
        META_FILE,
        EFFECTIVE_LENGTH_FILE,
        DISTANCE_BY_CHECKPOINT_FILE,
        POSITION_FREQUENCY_FILE,
        FIGURES_DIR,
    }
)
"""What a run's result directory holds beside its checkpoints' directories."""
MODEL_ENTRIES = frozenset({KEY_FILE, META_FILE, HIST_FILE, TESTS_DIR, FIGURES_DIR, *DERIVED_TABLES})
"""What a model's result directory holds."""


def check_results_dir(out: Path, run: bool = False) -> Path:
    """`out` if the probe may write a model's (or with `run`, a run's) results there: absent, empty, the probe's
    own, or an older probe's (`earlier_model_results`, `earlier_run_results`; then marked as its own). Anything
    else is an OutputDirError naming the folder and the fix, and nothing in it is touched."""
    return check_output_dir(out, PROBE, written_before=_earlier_results(run))


def claim_results_dir(out: Path, run: bool = False) -> Path:
    """Create (or reuse) the probe's result directory `out`, recording the probe as its owner (`check_results_dir`
    says when it is refused)."""
    return claim_output_dir(out, PROBE, written_before=_earlier_results(run), shared=True)


def _earlier_results(run: bool) -> Callable[[Path], bool]:
    """The test of an older probe's unmarked result directory of a run, or of one model."""
    return earlier_run_results if run else earlier_model_results


def earlier_model_results(out: Path) -> bool:
    """Whether an older probe (before owner records) wrote `out` for one model: its key.json is there, and beside
    it only the probe's own file names, tests/ of per-length records and figures/ of the figures it draws."""
    figures = figure_names(MODEL_FIGURES)
    return (
        json_object_with(out / KEY_FILE, "key", str)
        and own_entry_names(out) <= MODEL_ENTRIES
        and only_files(out / TESTS_DIR, lambda name: bool(RECORD_FILE.fullmatch(name)))
        and only_files(out / FIGURES_DIR, figures.__contains__)
    )


def earlier_run_results(out: Path) -> bool:
    """Whether an older probe wrote `out` for a run: checkpoint directories that are each the probe's (its own or
    `earlier_model_results`), and beside them only the run tables, a probe.json listing the checkpoints and the
    run figures."""
    checkpoints = own_entry_names(out) - RUN_ENTRIES
    figures = figure_names(RUN_FIGURES)
    return (
        bool(checkpoints)
        and all(_is_model_results(out / name) for name in checkpoints)
        and (
            not (out / META_FILE).exists() or json_object_with(out / META_FILE, "checkpoints", dict)
        )
        and only_files(out / FIGURES_DIR, figures.__contains__)
    )


def _is_model_results(path: Path) -> bool:
    """A model's result directory: the probe's own, or an older probe's."""
    return (
        path.is_dir()
        and not path.is_symlink()
        and (owner_of(path) == PROBE or earlier_model_results(path))
    )


def figure_names(stems: Sequence[str]) -> frozenset[str]:
    """The file names of figures drawn under `stems` (analysis/plots/frequency.py saves each as .png and .pdf)."""
    return frozenset(f"{stem}{suffix}" for stem in stems for suffix in (".png", ".pdf"))


def discard_records(out: Path) -> None:
    """Delete the probe's key, metadata, per-length records and derived tables in `out` (a directory it owns: its
    key.json is there, or its tests/ holds only its records), and nothing else: a reader never meets the old
    model's numbers beside the new key, and a user's other files stay. Figures are redrawn under their names."""
    for name in (KEY_FILE, META_FILE, HIST_FILE, *DERIVED_TABLES):
        (out / name).unlink(missing_ok=True)
    tests = out / TESTS_DIR
    for record in tests.iterdir() if tests.is_dir() else []:
        if RECORD_FILE.fullmatch(record.name) and record.is_file():
            record.unlink()
    if tests.is_dir() and not any(tests.iterdir()):
        tests.rmdir()


def length_files(out: Path, length: int) -> tuple[Path, Path]:
    """(records, completion marker) of one length."""
    return out / TESTS_DIR / f"L{length:06d}.jsonl", out / TESTS_DIR / f"L{length:06d}.json"


def done_lengths(out: Path, key: str, tests: int | None = None) -> dict[int, dict]:
    """Lengths already probed in `out` under `key` with at least `tests` tests (None: any number): length ->
    completion marker. Tests extend by prefix (test i depends only on seed, length and i), so a length
    probed with more tests than asked holds the asked ones."""
    done = {}
    for marker in sorted((out / TESTS_DIR).glob("L*.json")):
        if not MARKER_FILE.fullmatch(marker.name):
            continue  # a partial length's records
        try:
            meta = json.loads(marker.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a damaged marker: the length is redone
        if (
            isinstance(meta, dict)
            and meta.get("key") == key
            and isinstance(meta.get("n_tests"), int)
            and meta["n_tests"] >= (tests or 0)
            and marker.with_suffix(".jsonl").is_file()
        ):
            done[int(meta["length"])] = meta
    return done


def write_length(out: Path, length: int, records: Sequence[dict], marker: dict) -> None:
    """One length's records, then its completion marker (so a marker always means a whole file: the marker of
    fewer tests that these extend goes first)."""
    jsonl, marker_path = length_files(out, length)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)
    write_text_atomic(jsonl, "".join(json.dumps(r) + "\n" for r in records))
    write_json(marker_path, {"length": length, "n_tests": len(records), **marker})


def partial_file(out: Path, length: int) -> Path:
    """The records of a length being probed (`save_partial`), until `write_length` completes it."""
    return out / TESTS_DIR / f"L{length:06d}.partial.json"


def save_partial(out: Path, length: int, key: str, records: Sequence[dict], seconds: float) -> None:
    """The tests of `length` done so far under `key`, replaced atomically (a kill leaves the previous batch's)."""
    path = partial_file(out, length)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        path, {"key": key, "length": length, "seconds": seconds, "records": list(records)}
    )


def load_partial(out: Path, length: int, key: str) -> tuple[list[dict], float]:
    """(records, seconds) of the tests of `length` a killed probe finished under `key`: its records of tests
    0, 1, 2, ... up to the first that is not (seconds in proportion). Nothing (and the file is left for
    `discard_partial`) when the file is missing, damaged or from another key."""
    path = partial_file(out, length)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return [], 0.0
    if not (
        isinstance(data, dict)
        and data.get("key") == key
        and data.get("length") == length
        and isinstance(data.get("records"), list)
        and isinstance(data.get("seconds"), (int, float))
    ):
        return [], 0.0
    records = _leading_tests(data["records"], key, length)
    return records, float(data["seconds"]) * len(records) / max(1, len(data["records"]))


def load_started(out: Path, length: int, key: str) -> tuple[list[dict], float]:
    """(records, seconds) a probe of `length` under `key` goes on from: a killed probe's partial records, or
    the tests of a finished probe of that length (more tests extend it by prefix), whichever holds more. They
    may hold more tests than asked: all are kept, and readers take the first ones."""
    started = load_partial(out, length, key)
    marker = done_lengths(out, key).get(length)
    if marker is not None and isinstance(marker.get("seconds"), (int, float)):
        try:
            finished = _leading_tests(read_records(out, [length]), key, length)
        except StaleResults:
            finished = []  # a damaged file: its tests are probed again
        if len(finished) == marker["n_tests"] and len(finished) > len(started[0]):
            started = finished, float(marker["seconds"])
    return started


def _leading_tests(records: Sequence, key: str, length: int) -> list[dict]:
    """The records that are, in order, those of tests 0, 1, 2, ... of `length` under `key`."""
    matched = []
    for index, record in enumerate(records):
        if not (
            isinstance(record, dict)
            and record.get("key") == key
            and record.get("length") == length
            and record.get("index") == index
        ):
            break
        matched.append(record)
    return matched


def discard_partial(out: Path, length: int) -> None:
    """Delete the partial records of `length` (the probe's own file: `RECORD_FILE`)."""
    partial_file(out, length).unlink(missing_ok=True)


def read_records(out: Path, lengths: Sequence[int]) -> list[dict]:
    """The per-test records of the given lengths."""
    records = []
    for length in lengths:
        path = length_files(out, length)[0]
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if line.strip():
                try:  # a byte that is not UTF-8 is a damaged record like any other (both ValueErrors)
                    records.append(json.loads(line.decode("utf-8")))
                except ValueError as err:
                    raise StaleResults(
                        f"{path}, line {number}: damaged record ({err}). Fix: delete the file and its "
                        ".json marker to probe that length again"
                    ) from None
    return records


HIT_FIELDS = ("hits_anywhere", "hits_first_line")
TEACHER_FORCED_FIELDS = (("tf_token_accuracy", 0.0, 1.0), ("tf_logprob", -math.inf, 0.0))
"""A record's teacher-forced scores, one per needle, and their range: checked wherever a probe stored them (a probe
that decodes nothing must have them), so a damaged score never becomes a table's number."""


def checked_records(
    out: Path, length: int, marker: dict, greedy: bool = True, tests: int | None = None
) -> list[ProbeRecord]:
    """The first `tests` records (None: all) of one probed length, refused (StaleResults naming the file and line)
    unless the file is exactly what the probe wrote: as many records as the marker's n_tests, each under the
    marker's key and length, test i at line i + 1, with hit lists of JSON booleans (a probe with greedy off:
    teacher-forced accuracies in [0, 1]), and any teacher-forced scores it stored in range. A re-derivation must never turn a damaged or mixed file into a number."""
    path = length_files(out, length)[0]
    records = read_records(out, [length])
    fix = "Fix: restore the file, or delete it and its .json marker to probe that length again"
    if len(records) != marker.get("n_tests"):
        raise StaleResults(
            f"{path}: {len(records)} records, but its marker says {marker.get('n_tests')} tests. {fix}"
        )
    for number, record in enumerate(records, 1):
        where = f"{path}, record {number}"
        if (
            not isinstance(record, dict)
            or record.get("key") != marker.get("key")
            or record.get("length") != length
        ):
            raise StaleResults(
                f"{where}: made under another key or length than its marker "
                f"({str(marker.get('key'))[:12]}, L = {length}). {fix}"
            )
        for name in HIT_FIELDS if greedy else ():
            hits = record.get(name)
            if not isinstance(hits, list) or not all(isinstance(h, bool) for h in hits):
                raise StaleResults(
                    f"{where}: {name} must be a list of true/false, got {hits!r:.60}. {fix}"
                )
        needles = len(record.get("needles", ()))
        for name, low, high in TEACHER_FORCED_FIELDS:
            values = record.get(name)
            if (values is not None or not greedy) and not finite_numbers(
                values, needles, low, high
            ):
                raise StaleResults(
                    f"{where}: {name} must be a number in [{low}, {high}] per needle, got {values!r:.60}. {fix}"
                )
        if record.get("index") != number - 1:
            raise StaleResults(
                f"{where}: test index {record.get('index')!r:.20}, where the probe writes test {number - 1}. {fix}"
            )
    return records[:tests]


def finished_records(
    out: Path, meta: dict, tests: int | None = None
) -> dict[int, tuple[dict, list[ProbeRecord]]]:
    """Length -> (marker, checked records) of every length of a probe directory (with its probe.json `meta`) that
    is finished under its key: the first `tests` tests of each (None: as many as the probe.json asked)."""
    key = read_json(out / KEY_FILE)["key"]
    tests = int(tests or meta["settings"]["tests_per_length"])
    greedy = meta["settings"].get("greedy", True)  # probes before the setting decoded
    done = done_lengths(out, key, tests)
    return {
        n: (done[n], checked_records(out, n, done[n], greedy, tests))
        for n in meta["lengths"]
        if n in done
    }
