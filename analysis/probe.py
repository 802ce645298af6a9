"""Effective context length by 4-needle NIAH, for one checkpoint, a whole run, or a HF model.

    python analysis/probe.py --checkpoint DIR | --run RUNDIR | --model hf:DIR
        [--positions rope] [--position-option KEY=VALUE ...] [--lengths 128:2048:128]
        [--tests-per-length 500] [--batch-size 8] [--threshold 0.5] [--min-retrieved 2]
        [--max-new-tokens 128] [--haystack pg|noise|PATH] [--seed 0] [--out DIR] [--device cpu|cuda]
        [--dtype auto|float32|bfloat16] [--tokenizer SPEC] [--shard i/n] [--merge-only]

For each length (default 128, 256, ... up to the training length) the same seeded tests
(`analysis.niah`) are decoded greedily with the KV cache, a batch of equal-length prompts at a
time, stopping a row at EOS or at its first complete answer line (at most 128 new tokens), and
scored (pass: >= --min-retrieved of the 4 needles). Precision: `auto` is bf16 autocast on GPU and
float32 on CPU. The effective length is the largest length before the first one whose pass rate
is below --threshold (see analysis/effective_length.py for the edge cases).

Outputs of one model (OUT defaults: --checkpoint C -> runs/probe/<C name>; --model hf:D ->
runs/probe/<D name>; a non-rope --positions appends -<scheme>):

    OUT/probe.json              settings, settings key, seed, code version, haystack sha256, model,
                                effective length
    OUT/tests/L000128.jsonl     one line per test: test metadata (prompt_sha256, needles, positions,
                                depths, question_position) + score (hits, distances, answer, numbers,
                                retrieved, passed) + generated text and settings_key
    OUT/tests/L000128.json      completion marker of a length: settings_key, seconds, batch_size, device
    OUT/summary.csv             one row per length (analysis.effective_length.SUMMARY_COLUMNS)
    OUT/effective_length.csv    one row (the run-level format below)
    OUT/failure_by_thirds.csv/.md, OUT/figures/niah_heatmap.*, OUT/figures/failure_by_thirds.*

A run (--run RUNDIR probes every milestone RUNDIR/checkpoints/tokens-*/; OUT defaults to
RUNDIR/probe) writes one directory like the above per checkpoint, OUT/<tokens-N>/, then

    OUT/effective_length.csv    one row per checkpoint: tokens seen, effective length, status,
                                f(effective length) by Eq. 2 on its trained_lengths.npy, training
                                length, positions, pass_rate_<length> for every length
    OUT/position_frequency.csv  i, f: Eq. 2 on the last checkpoint's trained_lengths.npy
    OUT/probe.json              run-level settings and provenance
    OUT/figures/fig2a_*, fig2b_*

Resumable: a length whose marker has the same settings key is not decoded again, and a
checkpoint with every length done is not even loaded. The key covers the model, tokenizer,
haystack (and its hash), seed, tests per length, min retrieved, answer budget, positions and
precision; not the batch size, device or threshold (the threshold only enters the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.effective_length import (
    STATUS_NONE_PASSED,
    checkpoint_row,
    depth_grid,
    effective_length,
    failure_by_thirds,
    markdown_table,
    summarize_length,
    write_csv,
    write_effective_length_csv,
)
from analysis.niah import MAX_NEW_TOKENS, NiahBuilder, NiahTest, answer_complete, score_answer
from train.cli import code_version, parse_shard
from train.tokenizer import Tokenizer, get_tokenizer

PRECISIONS = ("auto", "float32", "bfloat16")


class Generator(Protocol):
    """What the probe needs of a model: greedy batched generation (train.model.Transformer.generate)."""

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]: ...


@dataclass(frozen=True)
class ProbeSettings:
    """Everything that decides the probe's answers (hashed into the settings key) plus the sweep."""

    tests_per_length: int = 500
    seed: int = 0
    haystack: str = "pg"
    min_retrieved: int = 2
    max_new_tokens: int = MAX_NEW_TOKENS
    positions: str = "rope"
    position_options: dict = field(default_factory=dict)
    precision: str = "float32"  # resolved: float32 or bfloat16 (autocast)
    tokenizer: str | None = None  # None: the model's own

    def key(self, model: str, haystack_sha256: str) -> str:
        """sha256 (16 hex) of the settings, the model's name and the haystack's hash."""
        blob = json.dumps({**asdict(self), "model": model, "haystack_sha256": haystack_sha256}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def parse_lengths(spec: str) -> list[int]:
    """'START:STOP:STEP' (STOP included) or a comma list '128,256,512' -> sorted unique lengths."""
    try:
        if ":" in spec:
            start, stop, step = (int(x) for x in spec.split(":"))
            if step < 1:
                raise ValueError
            lengths = list(range(start, stop + 1, step))
        else:
            lengths = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths expects START:STOP:STEP or a comma list, got {spec!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths {spec!r} gives no positive lengths")
    return sorted(set(lengths))


def parse_option(text: str) -> tuple[str, Any]:
    """'key=value' with value parsed as JSON when possible (numbers, true/false), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--position-option expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> bfloat16 autocast on CUDA, float32 on CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    if precision == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return precision


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for `bfloat16` (weights stay float32), nothing for float32."""
    if precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ decoding and scoring


def answer_stop(tokenizer: Tokenizer) -> Callable[[list[int]], bool]:
    """Stop a row at EOS or once its decoded text holds a complete answer line."""
    eos = tokenizer.eos_id

    def stop(tokens: list[int]) -> bool:
        return tokens[-1] == eos or answer_complete(tokenizer.decode(tokens))

    return stop


def cut_at_eos(tokens: Sequence[int], eos_id: int) -> list[int]:
    """The generated ids before the first EOS."""
    tokens = list(tokens)
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def generate_answers(
    model: Generator, tokenizer: Tokenizer, tests: Sequence[NiahTest], batch_size: int, device: torch.device,
    precision: str = "float32", max_new_tokens: int = MAX_NEW_TOKENS, progress: Any = None,
) -> list[str]:
    """Greedy answers (decoded, cut at EOS) to equal-length tests, `batch_size` prompts per generate call."""
    if len({t.length for t in tests}) > 1:
        raise ValueError("generate_answers needs tests of one length (prompts of a batch must be equal length)")
    stop = answer_stop(tokenizer)
    answers: list[str] = []
    for start in range(0, len(tests), batch_size):
        batch = tests[start : start + batch_size]
        prompt = torch.from_numpy(np.stack([t.input_ids for t in batch])).to(device)
        with torch.inference_mode(), autocast(precision, device):
            generated = model.generate(prompt, max_new_tokens, stop=stop)
        answers += [tokenizer.decode(cut_at_eos(g, tokenizer.eos_id)) for g in generated]
        if progress is not None:
            progress.update(len(batch))
    return answers


def score_tests(tests: Sequence[NiahTest], answers: Sequence[str], min_retrieved: int, key: str) -> list[dict]:
    """Per-test JSONL records: test metadata, score, the generated text and the settings key."""
    records = []
    for test, text in zip(tests, answers):
        record = {**test.record(), **score_answer(test, text, min_retrieved).record()}
        records.append({**record, "generated": text, "settings_key": key})
    return records


# ------------------------------------------------------------------ one model


def _length_files(out: Path, length: int) -> tuple[Path, Path]:
    return out / "tests" / f"L{length:06d}.jsonl", out / "tests" / f"L{length:06d}.json"


def _write_atomic(path: Path, text: str) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def done_lengths(out: Path, key: str) -> dict[int, dict]:
    """Lengths already probed in `out` with settings `key`: length -> completion marker."""
    done = {}
    for marker in sorted((out / "tests").glob("L*.json")):
        meta = json.loads(marker.read_text())
        if meta.get("settings_key") == key and marker.with_suffix(".jsonl").is_file():
            done[int(meta["length"])] = meta
    return done


def read_records(out: Path, lengths: Sequence[int]) -> list[dict]:
    """The per-test records of the given lengths."""
    records = []
    for length in lengths:
        with open(_length_files(out, length)[0]) as fh:
            records += [json.loads(line) for line in fh if line.strip()]
    return records


@dataclass
class ModelProbe:
    """A loaded model ready to probe: generator, tokenizer, name and training length."""

    model: Generator
    tokenizer: Tokenizer
    name: str
    train_len: int


def probe_lengths(
    probe: ModelProbe, builder: NiahBuilder, settings: ProbeSettings, key: str, lengths: Sequence[int], out: Path,
    batch_size: int, device: torch.device, show_progress: bool = True,
) -> None:
    """Decode and score every length not yet done with settings `key`, writing JSONL + marker per length."""
    from tqdm.auto import tqdm

    pending = [n for n in lengths if n not in done_lengths(out, key)]
    (out / "tests").mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(pending) * settings.tests_per_length, unit="test", disable=not show_progress,
               desc=probe.name, dynamic_ncols=True)
    with bar:
        for length in pending:
            bar.set_postfix_str(f"length {length}")
            tests = builder.make_tests(length, settings.tests_per_length, settings.seed)
            started = time.perf_counter()
            answers = generate_answers(probe.model, probe.tokenizer, tests, batch_size, device, settings.precision,
                                       settings.max_new_tokens, bar)
            seconds = time.perf_counter() - started
            records = score_tests(tests, answers, settings.min_retrieved, key)
            jsonl, marker = _length_files(out, length)
            _write_atomic(jsonl, "".join(json.dumps(r) + "\n" for r in records))
            _write_atomic(marker, json.dumps({"length": length, "settings_key": key, "n_tests": len(records),
                                              "seconds": seconds, "batch_size": batch_size,
                                              "device": str(device)}) + "\n")


def write_model_outputs(
    out: Path, name: str, key: str, lengths: Sequence[int], threshold: float, figures: bool = True,
) -> list[dict]:
    """summary.csv, failure_by_thirds.csv/.md and the per-model figures from the probed lengths; returns summary rows."""
    done = done_lengths(out, key)
    lengths = [n for n in lengths if n in done]
    summary = [summarize_length(read_records(out, [n]), done[n]["seconds"]) for n in lengths]
    write_csv(out / "summary.csv", summary)
    records = read_records(out, lengths)
    thirds = failure_by_thirds(records)
    write_csv(out / "failure_by_thirds.csv", thirds)
    _write_atomic(out / "failure_by_thirds.md", markdown_table(thirds))
    if figures and records:
        from analysis import plots

        grid_lengths, edges, recall = depth_grid(records)
        plots.plot_niah_heatmap(grid_lengths, edges, recall, out / "figures" / "niah_heatmap", title=name)
        plots.plot_failure_by_thirds(thirds, out / "figures" / "failure_by_thirds", title=name)
    return summary


# ------------------------------------------------------------------ model sources


def _train_len_from_files(checkpoint: Path) -> int:
    """The training length of a checkpoint: its trained-length histogram's size - 1, else max_seq_len."""
    hist = checkpoint / "trained_lengths.npy"
    if hist.is_file():
        return int(np.load(hist, mmap_mode="r").shape[0]) - 1
    from train.checkpoint import load_model_config

    return load_model_config(checkpoint).max_seq_len


def _prepare(model: torch.nn.Module, settings: ProbeSettings, device: torch.device) -> torch.nn.Module:
    """Move to the device in float32, select the position scheme, eval mode."""
    model = model.to(device=device, dtype=torch.float32).eval()
    if settings.positions != "rope" or settings.position_options:
        model.set_positions(settings.positions, **settings.position_options)
    return model


def load_checkpoint(path: Path, settings: ProbeSettings, device: torch.device, attention_backend: str = "auto") -> ModelProbe:
    """One of our checkpoints (trainer or consolidated) via train.checkpoint.load_model."""
    from train.checkpoint import load_model

    model, spec, _ = load_model(path, device="cpu", dtype=torch.float32, attention_backend=attention_backend)
    tokenizer = get_tokenizer(settings.tokenizer or spec["spec"])
    return ModelProbe(_prepare(model, settings, device), tokenizer, path.name, _train_len_from_files(path))


def load_hf(directory: Path, settings: ProbeSettings, device: torch.device, attention_backend: str = "auto") -> ModelProbe:
    """A Hugging Face Llama-family directory via train.hf.load_hf_model (tokenizer from its tokenizer.json)."""
    from train.hf import load_hf_model, tokenizer_spec

    spec = settings.tokenizer or tokenizer_spec(directory)
    if spec is None:
        raise SystemExit(f"--model hf:{directory}: no tokenizer.json there; pass --tokenizer SPEC (e.g. llama3)")
    model = load_hf_model(directory, dtype=torch.float32, attention_backend=attention_backend)
    return ModelProbe(_prepare(model, settings, device), get_tokenizer(spec), directory.name, model.config.max_seq_len)


def milestones(run_dir: Path) -> list[tuple[Path, int]]:
    """The run's complete milestone checkpoints (tokens-*/, never .tmp) with tokens seen, oldest first."""
    from train.checkpoint import MILESTONE_PREFIX, list_checkpoints

    found = [(p, int(m["tokens_seen"])) for p, m in list_checkpoints(run_dir) if p.name.startswith(MILESTONE_PREFIX)]
    if not found:
        raise SystemExit(f"--run {run_dir}: no complete checkpoints under {run_dir / 'checkpoints'}/tokens-*/")
    return found


def _tokens_seen(path: Path) -> int | None:
    """Tokens seen by a checkpoint, from trainer.json / meta.json, else None."""
    for name in ("trainer.json", "meta.json"):
        if (path / name).is_file():
            value = json.loads((path / name).read_text()).get("tokens_seen")
            return None if value is None else int(value)
    return None


# ------------------------------------------------------------------ orchestration


@dataclass
class Job:
    """What the CLI asked for, resolved."""

    settings: ProbeSettings
    lengths: list[int] | None
    batch_size: int
    threshold: float
    device: torch.device
    attention_backend: str = "auto"
    figures: bool = True
    show_progress: bool = True


def _meta(job: Job, builder_sha: str | None, **extra: Any) -> dict:
    """probe.json content: settings, sweep, provenance."""
    return {
        "settings": asdict(job.settings), "lengths": job.lengths, "batch_size": job.batch_size,
        "threshold": job.threshold, "device": str(job.device), "haystack_sha256": builder_sha,
        "code_version": code_version(), "command": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra,
    }


class Builders:
    """One NiahBuilder per tokenizer name (the haystack is tokenized once per tokenizer)."""

    def __init__(self, haystack: str) -> None:
        from analysis.niah import load_haystack

        self.haystack = load_haystack(haystack)
        self._by_name: dict[str, NiahBuilder] = {}

    def get(self, tokenizer: Tokenizer) -> NiahBuilder:
        if tokenizer.name not in self._by_name:
            self._by_name[tokenizer.name] = NiahBuilder(tokenizer, self.haystack)
        return self._by_name[tokenizer.name]


def probe_one(
    load: Callable[[], ModelProbe], name: str, train_len: int | None, out: Path, job: Job, builders: Builders,
    length_hist: np.ndarray | None = None, tokens_seen: int | None = None,
) -> dict:
    """Probe one model into `out` (skipping done lengths; loading it only if needed); its effective_length row."""
    key = job.settings.key(name, builders.haystack.sha256)
    lengths = job.lengths
    probe = None
    if train_len is None or set(lengths or _default_lengths(train_len)) - set(done_lengths(out, key)):
        probe = load()
        train_len = train_len or probe.train_len
        lengths = lengths or _default_lengths(train_len)
        probe_lengths(probe, builders.get(probe.tokenizer), job.settings, key, lengths, out, job.batch_size,
                      job.device, job.show_progress)
    lengths = lengths or _default_lengths(train_len)
    summary = write_model_outputs(out, name, key, lengths, job.threshold, job.figures)
    row = checkpoint_row(name, tokens_seen, train_len, job.settings.positions, summary, length_hist, job.threshold,
                         job.settings.min_retrieved, job.settings.tests_per_length)
    write_effective_length_csv(out / "effective_length.csv", [row])
    eff = effective_length([r["length"] for r in summary], [r["pass_rate"] for r in summary], job.threshold)
    meta = _meta(job, builders.haystack.sha256, model=name, settings_key=key, train_len=train_len,
                 tokens_seen=tokens_seen, probed_lengths=lengths, effective_length=asdict(eff))
    _write_atomic(out / "probe.json", json.dumps(meta, indent=1) + "\n")
    del probe
    return row


def _default_lengths(train_len: int) -> list[int]:
    """128, 256, ... up to the training length."""
    return list(range(128, train_len + 1, 128))


def probe_run(run_dir: Path, out: Path, job: Job, shard: tuple[int, int] | None = None, merge_only: bool = False) -> list[dict]:
    """Probe every milestone of a run (or shard i of n of them), then (unless sharded) write the run tables."""
    builders = Builders(job.settings.haystack)
    checkpoints = milestones(run_dir)
    mine = checkpoints if shard is None else checkpoints[shard[0] :: shard[1]]
    rows = []
    for path, tokens in ([] if merge_only else mine):
        hist = np.load(path / "trained_lengths.npy")
        rows.append(probe_one(lambda p=path: load_checkpoint(p, job.settings, job.device, job.attention_backend),
                              path.name, len(hist) - 1, out / path.name, job, builders, hist, tokens))
    if shard is not None:
        return rows
    return merge_run(run_dir, out, job, builders, checkpoints)


def merge_run(run_dir: Path, out: Path, job: Job, builders: Builders, checkpoints: list[tuple[Path, int]]) -> list[dict]:
    """effective_length.csv, position_frequency.csv, probe.json and Fig. 2a/2b of the probed checkpoints."""
    from analysis.effective_length import draw_run_figures, load_run
    from analysis.position_freq import position_frequency

    rows, missing = [], []
    for path, tokens in checkpoints:
        hist = np.load(path / "trained_lengths.npy")
        key = job.settings.key(path.name, builders.haystack.sha256)
        lengths = job.lengths or _default_lengths(len(hist) - 1)
        done = done_lengths(out / path.name, key)
        if not set(lengths) <= set(done):
            missing.append(path.name)
            continue
        summary = write_model_outputs(out / path.name, path.name, key, lengths, job.threshold, figures=False)
        rows.append(checkpoint_row(path.name, tokens, len(hist) - 1, job.settings.positions, summary, hist,
                                   job.threshold, job.settings.min_retrieved, job.settings.tests_per_length))
    if missing:
        print(f"warning: not yet probed with these settings (left out of effective_length.csv): {', '.join(missing)}",
              file=sys.stderr)
    if not rows:
        raise SystemExit(f"{out}: no checkpoint of {run_dir} is fully probed with these settings; nothing to merge")
    write_effective_length_csv(out / "effective_length.csv", rows)
    last = checkpoints[-1][0]
    hist = np.load(last / "trained_lengths.npy")
    f = position_frequency(hist, len(hist) - 1)
    write_csv(out / "position_frequency.csv", [{"i": i, "f": int(v)} for i, v in enumerate(f)])
    meta = _meta(job, builders.haystack.sha256, run=str(run_dir), position_frequency_from=last.name,
                 checkpoints=[r["checkpoint"] for r in rows], missing=missing)
    _write_atomic(out / "probe.json", json.dumps(meta, indent=1) + "\n")
    if job.figures:
        draw_run_figures([load_run(out)], out / "figures")
    return rows


# ------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    from train.positions import SCHEMES

    p = argparse.ArgumentParser(prog="python analysis/probe.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="one trainer checkpoint or consolidated model directory")
    src.add_argument("--run", type=Path, help="a training run directory: probe every RUN/checkpoints/tokens-*/")
    src.add_argument("--model", help="hf:DIR, a Hugging Face Llama-family model directory")
    p.add_argument("--positions", default="rope", choices=SCHEMES, help="position scheme (train.positions)")
    p.add_argument("--position-option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                   help="option for the position scheme (repeatable), e.g. shift=1365")
    p.add_argument("--lengths", type=parse_lengths, help="START:STOP:STEP (STOP included) or a comma list; "
                   "default 128:L:128 with L the training length")
    p.add_argument("--tests-per-length", type=int, default=500, help="NIAH tests per length (paper: 500)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--threshold", type=float, default=0.5, help="a length fails when its pass rate is below this")
    p.add_argument("--min-retrieved", type=int, default=2, help="needles (of 4) a passing answer must contain")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="greedy answer budget (the official script's 128)")
    p.add_argument("--haystack", default="pg", help="pg (Paul Graham essays), noise, or a .txt file / directory")
    p.add_argument("--seed", type=int, default=0, help="test seed: the same seed gives the same tests anywhere")
    p.add_argument("--tokenizer", help="override the model's tokenizer spec (llama3, bytes, hf:DIR)")
    p.add_argument("--out", type=Path, help="output directory (defaults in the module docstring)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=PRECISIONS, help="auto: bf16 autocast on GPU, float32 on CPU")
    p.add_argument("--attention-backend", default="auto", help="train.attention backend (auto, sdpa, flash, ...)")
    p.add_argument("--shard", type=parse_shard, help="with --run: probe checkpoints i, i+n, ... only, no merge")
    p.add_argument("--merge-only", action="store_true", help="with --run: only write the run tables and figures")
    p.add_argument("--no-figures", action="store_true", help="skip PNG/PDF figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, probe, print the effective length(s)."""
    args = build_parser().parse_args(argv)
    if (args.shard or args.merge_only) and not args.run:
        raise SystemExit("--shard and --merge-only need --run")
    if min(args.batch_size, args.tests_per_length, args.max_new_tokens) < 1:
        raise SystemExit("--batch-size, --tests-per-length and --max-new-tokens must be >= 1")
    device = torch.device(args.device)
    settings = ProbeSettings(
        tests_per_length=args.tests_per_length, seed=args.seed, haystack=args.haystack,
        min_retrieved=args.min_retrieved, max_new_tokens=args.max_new_tokens, positions=args.positions, position_options=dict(args.position_option),
        precision=resolve_precision(args.dtype, device), tokenizer=args.tokenizer,
    )
    job = Job(settings, args.lengths, args.batch_size, args.threshold, device, args.attention_backend,
              not args.no_figures, not args.quiet)
    suffix = "" if args.positions == "rope" else f"-{args.positions}"
    if args.run:
        out = args.out or args.run / f"probe{suffix}"
        rows = probe_run(args.run, out, job, args.shard, args.merge_only)
    else:
        builders = Builders(settings.haystack)
        if args.checkpoint:
            path = args.checkpoint
            hist_path = path / "trained_lengths.npy"
            hist = np.load(hist_path) if hist_path.is_file() else None
            train_len = _train_len_from_files(path)
            load = lambda: load_checkpoint(path, settings, device, args.attention_backend)  # noqa: E731
            tokens = _tokens_seen(path)
        else:
            if not args.model.startswith("hf:"):
                raise SystemExit(f"--model expects hf:DIR, got {args.model!r} (use --checkpoint for our checkpoints)")
            path = Path(args.model[3:])
            hist, train_len, tokens = None, None, None
            load = lambda: load_hf(path, settings, device, args.attention_backend)  # noqa: E731
        out = args.out or Path("runs/probe") / f"{path.name}{suffix}"
        rows = [probe_one(load, path.name, train_len, out, job, builders, hist, tokens)]
    for row in rows:
        status = row["effective_length_status"]
        flag = "" if status == "ok" else f" ({status}{': undefined' if status == STATUS_NONE_PASSED else ': lower bound'})"
        print(f"{row['checkpoint']}: effective length {row['effective_length']}{flag}, "
              f"f(effective length) = {row['f_effective_length'] or 'n/a'}")
    print(f"outputs in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
