"""Orchestration of a probe: the job, each model's pending lengths under its result key, decoding them
under one progress bar, and the run level (every milestone, or a shard of them, and the run's list of them).
Derivation comes after, from the stored records: analysis/tables/derive.py."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import KW_ONLY, asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from posfreq.analysis.keys import probe_result_key
from posfreq.analysis.niah import store
from posfreq.analysis.niah.decoding import (
    Generator,
    generate_answers,
    longest_answer,
    needle_answers,
    score_tests,
    teacher_forced,
    uncued_needle,
)
from posfreq.analysis.niah.needles import NiahBuilder
from posfreq.analysis.niah.settings import (
    MAX_PROBE_LENGTH,
    PRECISIONS,
    ProbeError,
    ProbeSettings,
)
from posfreq.analysis.niah.sources import Builders, ModelSource, checkpoint_source, milestones
from posfreq.train.atomic import atomic_open
from posfreq.train.command_line import code_version
from posfreq.train.model.attention_kernels import BackendError, explain_backend
from posfreq.train.positions.schemes import SINGLE_PASS_SCHEMES
from posfreq.train.progress import progress_bar
from posfreq.train.run_lock import RunLock


def token_budget(value: int | str | None, device: torch.device, on_cpu: int) -> int | None:
    """--batch-tokens or --prefill-tokens as the runner takes it: `auto` is `on_cpu` on a CPU and no cap (None)
    elsewhere; a number or None stays as given."""
    if value == "auto":
        return on_cpu if device.type == "cpu" else None
    return value


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> bfloat16 autocast on CUDA, float32 on CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    if precision == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if precision == "bfloat16-prefill" and device.type != "cpu":
        raise ValueError(
            "precision bfloat16-prefill is for CPUs (a bf16 prompt forward, float32 decoding steps); "
            f"on {device.type} use auto or bfloat16"
        )
    return precision


@dataclass
class Job:
    """What the CLI asked for, resolved: the settings' precision is that of `device`."""

    settings: ProbeSettings
    """What decides the answers."""
    lengths: list[int] | None
    """Test lengths; None: 128, 256, ... up to each model's training length."""
    batch_size: int
    """Prompts decoded together, at most."""
    device: torch.device
    """Where the models run."""
    _: KW_ONLY  # the switches below by name only: Job(settings, lengths, batch, device, show_progress=False)
    attention_backend: str = "auto"
    """posfreq.train.model.attention backend."""
    show_progress: bool = True
    """Show a progress bar."""
    replace_stale: bool = False
    """Delete results in an output directory made under another key (else refuse)."""
    batch_tokens: int | None = None
    """At most this many test tokens decoded together (a batch of at least one test); None: no cap."""
    prefill_tokens: int | None = None
    """At most this many prompt tokens in one forward (whole prompts, one at least); None: a batch at once."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("batch_tokens", "prefill_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        self.settings = replace(
            self.settings, precision=resolve_precision(self.settings.precision, self.device)
        )
        self.attention = self._attention_choice()

    def _attention_choice(self) -> str:
        """The attention backend the probe runs and why; ValueError when the asked one cannot run this probe."""
        if (
            self.settings.engine == "transformers"
            and self.settings.positions in SINGLE_PASS_SCHEMES
        ):
            return (
                "transformers' own: the model's sdpa (eager for a model without it)"
                if self.settings.positions == "rope"
                else "transformers' sdpa, with the scheme's rotary frequencies"
            )
        dtype = (
            torch.bfloat16
            if self.settings.precision in ("bfloat16", "bfloat16-prefill")
            else torch.float32
        )
        merges = (
            self.settings.positions not in SINGLE_PASS_SCHEMES
        )  # two passes merged by their log-sum-exp
        try:
            return explain_backend(self.attention_backend, self.device, dtype, return_lse=merges)[1]
        except BackendError as err:
            raise ValueError(f"--attention-backend: {err}") from None

    def batch_for(self, length: int) -> int:
        """Tests of `length` tokens decoded together: batch_size, fewer where batch_tokens caps it (never 0)."""
        if self.batch_tokens is None:
            return self.batch_size
        return max(1, min(self.batch_size, self.batch_tokens // length))

    def lengths_for(self, train_len: int, shortest: int = 1) -> list[int]:
        """The lengths asked for, or the default ones of a model trained at `train_len` (none below `shortest`)."""
        return self.lengths or default_lengths(train_len, shortest)


def default_lengths(train_len: int, shortest: int = 1) -> list[int]:
    """The multiples of 128 from the shortest test a prompt format allows up to the training length; ProbeError for
    a training length beyond the longest test the probe builds (a config's max_position_embeddings of 2^40 made a
    list of 8.6e9 lengths)."""
    if train_len > MAX_PROBE_LENGTH:
        raise ProbeError(
            f"the model's training length {train_len:,} is beyond the longest test the probe builds "
            f"({MAX_PROBE_LENGTH:,} tokens), so there are no default lengths up to it. Fix: pass --lengths"
        )
    return list(range(128 * max(1, -(-shortest // 128)), train_len + 1, 128))


@dataclass
class ModelTask:
    """One model's pending work: where its results go, under which key, and which lengths remain."""

    source: ModelSource
    out: Path
    key: str
    parts: dict
    builder: NiahBuilder
    lengths: list[int]
    pending: list[int]


def check_model(source: ModelSource, job: Job, builders: Builders) -> tuple[NiahBuilder, list[int]]:
    """(prompt builder, lengths to probe) of one model; ProbeError for what cannot run, before anything is
    written (no result folder is claimed for a probe that is refused)."""
    builder = builders.for_source(source, job.settings)
    shortest = builder.min_length()
    lengths = job.lengths_for(source.train_len, shortest)
    if not lengths:
        raise ProbeError(
            f"{source.path} was trained at L = {source.train_len}, below the shortest test tokenizer "
            f"{builder.tokenizer.name} allows with an answer budget of {job.settings.max_new_tokens} "
            f"({shortest} tokens). Fix: train at a longer data.train-len, or pass --lengths from "
            f"{shortest} on (beyond the training length) or a lower --max-new-tokens"
        )
    if min(lengths) < shortest:
        raise ProbeError(
            f"--lengths: {min(lengths)} is below the shortest test this tokenizer and answer budget "
            f"allow ({shortest} tokens); start the lengths there or lower --max-new-tokens"
        )
    if job.settings.teacher_forced:
        answer = longest_answer(
            builder.tokenizer, builder.build(lengths[0], 0, 0), job.settings.answer_order
        )
        if answer > job.settings.max_new_tokens:
            raise ProbeError(
                f"the teacher-forced reference answer takes {answer} tokens of tokenizer "
                f"{builder.tokenizer.name}, more than the answer budget {job.settings.max_new_tokens}. "
                f"Fix: --max-new-tokens {answer} or more (or, in posfreq probe, --teacher-forced false, "
                "which drops the teacher-forced scores)"
            )
        if job.settings.answer_order == "alone":
            # every test's needles have the same number of digits: the first test stands for all
            first = builder.build(lengths[0], 0, 0)
            if problem := uncued_needle(first, needle_answers(builder.tokenizer, first)):
                raise ProbeError(problem)
    return builder, lengths


def skipped_lengths_note(
    source: ModelSource, job: Job, builder: NiahBuilder, lengths: list[int]
) -> str | None:
    """A line naming the default lengths below the shortest test the prompt format allows (left out of the
    probe), or None when none is left out or the lengths were given; `builder` and `lengths` are check_model's."""
    if job.lengths:
        return None
    left_out = [n for n in default_lengths(source.train_len) if n < lengths[0]]
    if not left_out:
        return None
    return (
        f"lengths {left_out[0]}-{left_out[-1]} left out: the shortest test of tokenizer {builder.tokenizer.name} "
        f"(instruction, 4 needles, question and an answer budget of {job.settings.max_new_tokens}) takes "
        f"{builder.min_length()} tokens; probing {lengths[0]}-{lengths[-1]}"
    )


def plan_model(
    source: ModelSource, out: Path, job: Job, builder: NiahBuilder, lengths: list[int]
) -> ModelTask:
    """Claim `out` for this model's key and list the lengths still to probe (`builder` and `lengths` are
    check_model's)."""
    key, parts = probe_result_key(source, builder, job.settings)
    try:
        store.claim(out, key, parts, job.replace_stale)
    except store.StaleResults as err:
        raise ProbeError(str(err)) from None
    done = store.done_lengths(out, key, job.settings.tests_per_length)
    return ModelTask(
        source, out, key, parts, builder, lengths, [n for n in lengths if n not in done]
    )


def execute(tasks: Sequence[ModelTask], job: Job) -> None:
    """Probe every pending length of every model task under one progress bar (tests, with an ETA over all of them)."""
    total = sum(len(t.pending) for t in tasks) * job.settings.tests_per_length
    if total and job.show_progress:
        print(f"attention: {job.attention}", file=sys.stderr)
    with progress_bar(
        total=total, unit="test", disable=not job.show_progress or total == 0, desc="probe"
    ) as bar:
        for task in tasks:
            if task.pending:
                model = task.source.load(job.settings, job.device, job.attention_backend)
                for length in task.pending:
                    bar.set_postfix_str(f"{task.source.name} length {length}")
                    probe_length(model, task, length, job, bar)
                del model
            _write_meta(task, job)


def _scored_batch(model: Generator, task: ModelTask, batch: list, job: Job) -> list[dict]:
    """The records of one batch of equal-length tests: decoded (unless greedy is off), teacher-forced, scored;
    FloatingPointError where the model's logits are not finite."""
    s = job.settings
    tokenizer = task.builder.tokenizer
    answers = (
        generate_answers(
            model, tokenizer, batch, job.device, s.precision, s.max_new_tokens, job.prefill_tokens
        )
        if s.greedy
        else None
    )
    tf = (
        teacher_forced(
            model, tokenizer, batch, job.device, s.precision, s.answer_order, job.prefill_tokens
        )
        if s.teacher_forced
        else None
    )
    return score_tests(batch, answers, tf, task.key)


def probe_length(model: Generator, task: ModelTask, length: int, job: Job, bar: Any = None) -> None:
    """Decode (unless greedy is off), teacher-force and score one length's tests in batches, from where a killed
    probe stopped (its partial records) or an earlier probe with fewer tests ended; write its records and marker."""
    s = job.settings
    tests = task.builder.make_tests(length, s.tests_per_length, s.seed)
    records, earlier = store.load_started(task.out, length, task.key)
    if records and bar is not None:
        # resumed: what a killed or shorter probe finished is not probed again
        bar.update(min(len(records), len(tests)))
    started = time.perf_counter()
    size = job.batch_for(length)
    for start in range(len(records), len(tests), size):
        batch = tests[start : start + size]
        try:
            records += _scored_batch(model, task, batch, job)
        except FloatingPointError as err:
            raise ProbeError(
                f"{task.source.path}: {err} at length {length}, tests {batch[0].index}-{batch[-1].index}: its "
                "answers and scores would be numbers made of NaN. Fix: probe with --precision float32, or check "
                "the model's weights"
            ) from None
        # kept through write_length too: it removes the marker of the fewer tests these may extend
        seconds = earlier + time.perf_counter() - started
        store.save_partial(task.out, length, task.key, records, seconds)
        if bar is not None:
            bar.update(len(batch))
    store.write_length(
        task.out,
        length,
        records,
        {
            "key": task.key,
            "seconds": earlier + time.perf_counter() - started,
            "batch_size": size,
            "prefill_tokens": job.prefill_tokens,
            "device": str(job.device),
            "threads": torch.get_num_threads(),
        },
    )
    store.discard_partial(task.out, length)


def _write_meta(task: ModelTask, job: Job) -> None:
    """probe.json (provenance) and the trained-length histogram beside the records."""
    source = task.source
    if source.length_hist is not None:
        with atomic_open(
            task.out / store.HIST_FILE, "wb"
        ) as f:  # never through a link at that name
            np.save(f, source.length_hist.astype(np.int64), allow_pickle=False)
    store.write_json(
        task.out / store.META_FILE,
        {
            "model": source.name,
            "model_path": str(source.path),
            "model_kind": source.kind,
            "key": task.key,
            "key_parts": task.parts,
            "settings": asdict(job.settings),
            "lengths": task.lengths,
            "train_len": source.train_len,
            "tokens_trained": source.tokens_trained,
            "run_tokens": source.run_tokens,
            "prompt_format": asdict(task.builder.format),
            "tokenizer": task.builder.tokenizer.name,
            "haystack": task.builder.haystack.name,
            "haystack_sha256": task.builder.haystack.sha256,
            "note": "a test of length n is a prompt of n - max_new_tokens tokens plus at most max_new_tokens "
            "generated ones: no token is generated at a position >= n",
            "batch_size": job.batch_size,
            "batch_tokens": job.batch_tokens,
            "device": str(job.device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "code_version": code_version(),
            "command": sys.argv,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def probe_models(
    sources: Sequence[ModelSource],
    outs: Sequence[Path],
    job: Job,
    builders: Builders,
    checked: Sequence[tuple[NiahBuilder, list[int]]] | None = None,
) -> None:
    """Probe models into their result directories (their tables: analysis/tables/derive.py).

    `checked`: each source's `check_model` answer where the caller already has it.
    """
    # what cannot run is refused before any folder is claimed
    if checked is None:
        checked = [check_model(source, job, builders) for source in sources]
    note = skipped_lengths_note(sources[0], job, *checked[0]) if sources else None
    if note:
        print(note, file=sys.stderr)
    for out in outs:  # every folder refused before any key is computed or model loaded
        store.claim_results_dir(out)
    # One probe per result folder at a time: a second one (another job on the same --out) is refused in one
    # line instead of interleaving its records and tables with the first one's. Shards of a run never share one.
    with ExitStack() as held:
        for out in outs:
            lock = RunLock.acquire(out)
            held.callback(lock.release)
        tasks = [plan_model(s, o, job, *c) for s, o, c in zip(sources, outs, checked)]
        execute(tasks, job)


def run_out_default(run_dir: Path, first: ModelSource, job: Job, builders: Builders) -> Path:
    """RUNDIR/probe-<scheme>-<key of the settings, prompts and code> (model content is keyed per checkpoint)."""
    key, _ = probe_result_key(
        first, builders.for_source(first, job.settings), job.settings, model=False
    )
    return run_dir / f"probe-{job.settings.positions}-{key[:8]}"


def probe_run(
    run_dir: Path,
    out: Path | None,
    job: Job,
    shard: tuple[int, int] | None = None,
    merge_only: bool = False,
) -> tuple[Path, list[Path]]:
    """Probe every milestone of a run (or shard i of n of them) into the run's result directory, and (unless
    sharded) record the run's checkpoints and their keys in its probe.json for the run tables
    (analysis/tables/derive.py). Returns (the run's result directory, the checkpoint directories probed).

    A given `out` is checked before the checkpoints are read (a user's folder is refused untouched), and claimed
    for the probe before anything is written there."""
    if out is not None:
        store.check_results_dir(out, run=True)
    builders = Builders(job.settings.haystack)
    checkpoints = milestones(run_dir)
    mine = checkpoints if shard is None else checkpoints[shard[0] :: shard[1]]
    sources = {
        p: checkpoint_source(p, job.settings) for p in (mine if shard is not None else checkpoints)
    }
    out = out or run_out_default(run_dir, sources[mine[0]], job, builders)
    # what cannot run is refused before the run's results folder is claimed
    checked = [] if merge_only else [check_model(sources[p], job, builders) for p in mine]
    store.claim_results_dir(out, run=True)
    probed = [] if merge_only else [out / p.name for p in mine]
    if probed:
        probe_models([sources[p] for p in mine], probed, job, builders, checked=checked)
    if shard is not None:
        return out, probed
    keys = {
        p.name: probe_result_key(s, builders.for_source(s, job.settings), job.settings)[0]
        for p, s in sources.items()
    }
    meta_path = out / store.META_FILE
    previous = store.read_json(meta_path) if meta_path.is_file() else {}
    store.write_json(
        meta_path,
        {
            **previous,
            "run": str(run_dir.resolve()),
            "checkpoints": keys,
            "settings": asdict(job.settings),
            "code_version": code_version(),
        },
    )
    return out, probed
