"""Effective context length by 4-needle NIAH, for one checkpoint, a whole run, or a HF model.

    python analysis/probe.py --checkpoint DIR | --run RUNDIR | --model hf:DIR  [options; --help lists them]

For each length n (default 128, 256, ... up to the training length) the same seeded tests
(`analysis.niah`) are built as prompts of n - B tokens, B the answer budget (`--max-new-tokens`,
default 128, as the official script), so no answer token sits at a position >= n. They are
decoded greedily with the KV cache, a batch of equal-length prompts at a time, each row stopping
at EOS, once all four needles appeared, or after B tokens, and scored by the needles found
anywhere in the answer (the stricter first-line rule is stored beside it). A teacher-forced
score comes from one forward pass over prompt + reference answer: per needle, the log-probability
of its tokens and the share of them that are the model's argmax. Precision: `auto` is bf16
autocast on GPU and float32 on CPU.

Prompts: `--bos auto` follows how the model saw text in training: for our checkpoints, as the
trainer's shards hold it (no BOS), for Hugging Face models as their tokenizer's post-processor
or `add_bos_token` says; with `--chat-template true` the template frames the prompt as one user turn
(the answer prefix opens the assistant's turn) and no BOS is added beyond what it renders.

Results are keyed by content (`analysis.results`): the model's weight and config files, the
prompts' ingredients (tokenizer files, haystack, frame), every decoding setting (scheme and its
options included) and the source of the code that decides answers. A length already probed
under the same key is never decoded again; results under another key are never reused. Default
outputs: runs/probe/<name>-<key> for one model, RUNDIR/probe-<scheme>-<key> for a run (one
directory per checkpoint inside, then the run tables: effective_length.csv with bootstrap
intervals and f, distance_by_checkpoint.csv, position_frequency.csv, Fig. 2a/2b). Threshold,
needles per pass and scoring rule only enter the derived tables: change them with
`analysis/effective_length.py --threshold ...` without probing again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Protocol, Sequence, Union, get_args

import numpy as np
import torch
from jsonargparse import ArgumentParser, Namespace

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from posfreq.analysis import results
from posfreq.analysis.effective_length import STATUS_NONE_PASSED, Analysis
from posfreq.analysis.niah import (
    ANSWER_BUDGET,
    NiahBuilder,
    NiahTest,
    PromptFormat,
    all_needles_in,
    answer_text,
    load_haystack,
    score_answer,
)
from posfreq.train.attention import BACKENDS, BackendError, explain_backend
from posfreq.train.cli import code_version, command_parser, parse, parse_shard
from posfreq.train.fingerprint import code_sha256
from posfreq.train.positions import SCHEMES, SINGLE_PASS_SCHEMES
from posfreq.train.tokenizer import Tokenizer, get_tokenizer

Precision = Literal["auto", "float32", "bfloat16", "bfloat16-prefill"]
BosPolicy = Literal["auto", "always", "never"]
CPU_BATCH_TOKENS = 8192
"""--batch-tokens auto on a CPU: the most test tokens decoded together."""
CPU_PREFILL_TOKENS = 2048
"""--prefill-tokens auto on a CPU: the most prompt tokens in one forward (train.model.row_groups)."""
AnswerOrder = Literal["document", "nearest_first"]
SchemeName = Literal[SCHEMES]  # the position schemes of posfreq.train.positions
AttentionBackend = Literal[BACKENDS]
PRECISIONS: tuple[str, ...] = get_args(Precision)
BOS_POLICIES: tuple[str, ...] = get_args(BosPolicy)
ANSWER_ORDERS: tuple[str, ...] = get_args(AnswerOrder)


class Generator(Protocol):
    """What the probe needs of a model (train.model.Transformer): greedy decoding and teacher forcing."""

    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        stop: Callable[[int, list[int]], bool] | None = None,
        prefill_dtype: torch.dtype | None = None,
        prefill_tokens: int | None = None,
    ) -> list[list[int]]: ...

    def target_logprobs(
        self, input_ids: torch.Tensor, first_target: int, prefill_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class ProbeSettings:
    """What decides the probe's answers (hashed into the result key, with the model and the prompts)."""

    tests_per_length: int = 500
    """NIAH tests per length (the paper: 500)."""
    seed: int = 0
    """Test seed: the same seed builds the same tests (needles, depths, haystack windows) anywhere."""
    haystack: str = "pg"
    """The haystack: pg (Paul Graham essays), noise, or a .txt file or a directory of them."""
    max_new_tokens: int = ANSWER_BUDGET
    """The answer budget B: a test of length n is a prompt of n - B tokens and at most B generated ones
    (the official script's 128), so no token is generated at a position >= n."""
    positions: SchemeName = "rope"
    """The position scheme the model decodes with (posfreq.train.positions)."""
    position_options: dict[str, Union[bool, int, float, str, None]] = field(default_factory=dict)
    """Options of the position scheme, e.g. {shift: 1365} (or --position-options.shift 1365)."""
    precision: Precision = "auto"
    """auto: bf16 autocast on GPU and float32 on CPU (resolved before results are keyed); float32; bfloat16
    (autocast over float32 weights); or bfloat16-prefill (the prompt's forward and the teacher-forced pass under
    bf16 autocast, the KV cache and the decoding steps in float32: the fastest on a CPU with bf16 units, see the
    README's Performance section)."""
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
    answer_order: AnswerOrder = "document"
    """Needle order of the teacher-forced reference answer: as in the document, or nearest the question first."""

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
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def decoding(self) -> dict:
        """The settings that change answers given the prompts (names of files excluded: content is keyed apart)."""
        keep = (
            "tests_per_length",
            "seed",
            "max_new_tokens",
            "positions",
            "position_options",
            "precision",
            "teacher_forced",
            "answer_order",
        )
        return {k: v for k, v in asdict(self).items() if k in keep}


def result_key(parts: dict) -> str:
    """sha256 (16 hex) of the key's parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


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
        raise argparse.ArgumentTypeError(
            f"--lengths expects START:STOP:STEP or a comma list, got {spec!r}"
        ) from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths {spec!r} gives no positive lengths")
    return sorted(set(lengths))


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


def autocast(
    precision: str, device: torch.device, prefill: bool = False
) -> contextlib.AbstractContextManager:
    """bf16 autocast for `bfloat16`, and for `bfloat16-prefill` around a prefill-only pass (weights stay float32);
    nothing otherwise."""
    if precision == "bfloat16" or (prefill and precision == "bfloat16-prefill"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ decoding and scoring


def cut_at_eos(tokens: Sequence[int], eos_id: int) -> list[int]:
    """The generated ids before the first EOS."""
    tokens = list(tokens)
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def generate_answers(
    model: Generator,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    device: torch.device,
    precision: str = "float32",
    max_new_tokens: int = ANSWER_BUDGET,
    prefill_tokens: int | None = None,
) -> list[str]:
    """Greedy answers (decoded, cut at EOS) to equal-length tests, decoded together.

    A row stops at EOS or once all four of its needles appeared (its score can no longer change).
    The prompts' forward takes at most `prefill_tokens` tokens at a time (None: all at once).
    """
    if len({t.prompt_length for t in tests}) > 1:
        raise ValueError(
            "generate_answers needs prompts of one length (a batch must be rectangular)"
        )

    def stop(row: int, tokens: list[int]) -> bool:
        return tokens[-1] == tokenizer.eos_id or all_needles_in(
            tests[row].needles, tokenizer.decode(tokens)
        )

    prompt = torch.from_numpy(np.stack([t.input_ids for t in tests])).to(device)
    prefill_dtype = torch.bfloat16 if precision == "bfloat16-prefill" else None
    with torch.inference_mode(), autocast(precision, device):
        generated = model.generate(
            prompt,
            max_new_tokens,
            stop=stop,
            prefill_dtype=prefill_dtype,
            prefill_tokens=prefill_tokens,
        )
    return [tokenizer.decode(cut_at_eos(g, tokenizer.eos_id)) for g in generated]


def reference_answer(
    tokenizer: Tokenizer, test: NiahTest, order: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the reference answer (`niah.answer_text`) and each needle's token span in it, by test needle.

    Tokenized piece by piece (separators and numbers apart), so each needle's tokens are exact;
    the pieces decode to the answer text.
    """
    if order not in ANSWER_ORDERS:
        raise ValueError(f"answer order must be one of {ANSWER_ORDERS}, got {order!r}")
    ranked = (
        sorted(range(len(test.needles)), key=lambda j: -test.positions[j])
        if order == "nearest_first"
        else list(range(len(test.needles)))
    )
    text = answer_text([test.needles[j] for j in ranked])
    ids: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    cursor = 0
    for j in ranked:
        at = text.index(test.needles[j], cursor)
        ids += tokenizer.encode(text[cursor:at])
        number = tokenizer.encode(test.needles[j])
        spans[j] = (len(ids), len(ids) + len(number))
        ids += number
        cursor = at + len(test.needles[j])
    ids += tokenizer.encode(text[cursor:])
    return ids, [spans[j] for j in range(len(test.needles))]


def teacher_forced(
    model: Generator,
    tokenizer: Tokenizer,
    tests: Sequence[NiahTest],
    device: torch.device,
    precision: str = "float32",
    order: str = "document",
    prefill_tokens: int | None = None,
) -> list[dict]:
    """Per test: each needle's summed log-probability and token accuracy under teacher forcing, one forward pass.

    The reference answer follows the prompt, right-padded to the batch's longest; causal attention
    keeps the padding out of every scored position, and prompt + answer stays within the test length.
    A forward takes at most `prefill_tokens` tokens (None: the whole batch).
    """
    answers = [reference_answer(tokenizer, t, order) for t in tests]
    prompt_length = tests[0].prompt_length
    for test, (ids, _) in zip(tests, answers):
        if len(ids) > test.answer_budget:
            raise ValueError(
                f"the reference answer takes {len(ids)} tokens, more than the answer budget "
                f"{test.answer_budget}. Fix: raise --max-new-tokens to at least {len(ids)}"
            )
    width = max(len(ids) for ids, _ in answers)
    batch = np.full((len(tests), prompt_length + width), tokenizer.eos_id, dtype=np.int64)
    for row, (test, (ids, _)) in enumerate(zip(tests, answers)):
        batch[row, :prompt_length] = test.input_ids
        batch[row, prompt_length : prompt_length + len(ids)] = ids
    with torch.inference_mode(), autocast(precision, device, prefill=True):
        logprobs, correct = model.target_logprobs(
            torch.from_numpy(batch).to(device), prompt_length, prefill_tokens
        )
    logprobs, correct = logprobs.float().cpu().numpy(), correct.cpu().numpy()
    scores = []
    for row, (_, spans) in enumerate(answers):
        scores.append(
            {
                "tf_logprob": [float(logprobs[row, a:b].sum()) for a, b in spans],
                "tf_token_accuracy": [float(correct[row, a:b].mean()) for a, b in spans],
                "tf_answer_order": order,
            }
        )
    return scores


def score_tests(
    tests: Sequence[NiahTest], answers: Sequence[str], tf: Sequence[dict] | None, key: str
) -> list[dict]:
    """Per-test JSONL records: test metadata, the generated text, both scores, the teacher-forced score, the key."""
    records = []
    for i, (test, text) in enumerate(zip(tests, answers)):
        record = {
            **test.record(),
            **score_answer(test, text).record(),
            "generated": text,
            "key": key,
        }
        records.append({**record, **(tf[i] if tf is not None else {})})
    return records


# ------------------------------------------------------------------ model sources


@dataclass
class ModelSource:
    """A model the probe can load, known by content before it is loaded: name, fingerprint, tokenizer, lengths."""

    name: str
    path: Path
    kind: str  # "checkpoint" (ours: trainer or consolidated) or "hf"
    fingerprint: str
    tokenizer_spec: str
    train_len: int
    vocab_size: int
    bos_in_training: bool
    length_hist: np.ndarray | None = None
    tokens_seen: int | None = None
    tokens_this_run: int | None = None

    def load(
        self, settings: ProbeSettings, device: torch.device, attention_backend: str = "auto"
    ) -> Generator:
        """The model on `device` in float32, eval mode, with the settings' position scheme."""
        if self.kind == "checkpoint":
            from posfreq.train.checkpoint import load_model

            model, _, _ = load_model(
                self.path, device="cpu", dtype=torch.float32, attention_backend=attention_backend
            )
        else:
            from posfreq.train.hf import load_hf_model

            model = load_hf_model(
                self.path, dtype=torch.float32, attention_backend=attention_backend
            )
        model = model.to(device=device, dtype=torch.float32).eval()
        if settings.positions != "rope" or settings.position_options:
            model.set_positions(settings.positions, **settings.position_options)
        return model


def checkpoint_source(path: Path, settings: ProbeSettings) -> ModelSource:
    """One of our checkpoints (trainer milestone or consolidated directory)."""
    from posfreq.train.checkpoint import load_model_config, model_fingerprint

    if not (path / "model_config.json").is_file():
        what = (
            "does not exist" if not path.exists() else "is not a checkpoint (no model_config.json)"
        )
        raise SystemExit(
            f"error: --checkpoint {path} {what}. Fix: pass RUN/checkpoints/tokens-*/ (or latest/), a "
            "consolidated model directory, or --run RUN for every milestone"
        )
    spec_file = path / "tokenizer_spec.json"
    spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
    if settings.tokenizer is None and "spec" not in spec:
        raise SystemExit(
            f"{path}: no tokenizer_spec.json; pass --tokenizer SPEC (llama3, bytes, hf:DIR)"
        )
    hist_file = path / "trained_lengths.npy"
    hist = np.load(hist_file, allow_pickle=False) if hist_file.is_file() else None
    config = load_model_config(path)
    this_run, before = _tokens(path)
    return ModelSource(
        path.name,
        path,
        "checkpoint",
        model_fingerprint(path),
        settings.tokenizer or spec["spec"],
        config.train_len,
        config.vocab_size,
        bool(spec.get("bos_in_training", False)),
        hist,
        None if this_run is None else this_run + before,
        this_run,
    )


def hf_source(directory: Path, settings: ProbeSettings) -> ModelSource:
    """A Hugging Face Llama-family directory (its tokenizer.json unless --tokenizer overrides)."""
    from posfreq.train.hf import config_from_hf, hf_model_fingerprint, tokenizer_spec

    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "holds no config.json"
        raise SystemExit(
            f"error: --model hf:{directory} {what}. Fix: pass a Hugging Face model directory "
            "(config.json and *.safetensors)"
        )
    spec = settings.tokenizer or tokenizer_spec(directory)
    if spec is None:
        raise SystemExit(
            f"--model hf:{directory}: no tokenizer.json there; pass --tokenizer SPEC (e.g. llama3)"
        )
    config = config_from_hf(
        json.loads((directory / "config.json").read_text()), str(directory / "config.json")
    )
    return ModelSource(
        directory.name,
        directory,
        "hf",
        hf_model_fingerprint(directory),
        spec,
        config.train_len,
        config.vocab_size,
        get_tokenizer(spec).adds_bos,
    )


def _tokens(path: Path) -> tuple[int | None, int]:
    """(tokens this checkpoint's run trained, tokens its initial weights had seen before) from trainer/meta.json."""
    for name in ("trainer.json", "meta.json"):
        if (path / name).is_file():
            meta = json.loads((path / name).read_text())
            value = meta.get("tokens_seen")
            return (None if value is None else int(value)), int(meta.get("tokens_before", 0))
    return None, 0


def milestones(run_dir: Path) -> list[Path]:
    """The run's complete milestone checkpoints (tokens-*/, never .tmp), oldest first."""
    from posfreq.train.checkpoint import MILESTONE_PREFIX, list_checkpoints

    found = [p for p, _ in list_checkpoints(run_dir) if p.name.startswith(MILESTONE_PREFIX)]
    if not found:
        raise SystemExit(
            f"--run {run_dir}: no complete checkpoints under {run_dir / 'checkpoints'}/tokens-*/"
        )
    return found


# ------------------------------------------------------------------ orchestration


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
    analysis: Analysis = Analysis()
    """How the records become the derived tables."""
    attention_backend: str = "auto"
    """posfreq.train.attention backend."""
    figures: bool = True
    """Draw the figures beside the tables."""
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
    """The multiples of 128 from the shortest test a prompt format allows up to the training length."""
    return list(range(128 * max(1, -(-shortest // 128)), train_len + 1, 128))


class Builders:
    """One NiahBuilder per (tokenizer content, prompt format): the haystack is tokenized once for each."""

    def __init__(self, haystack: str) -> None:
        self.haystack = load_haystack(haystack)
        self._built: dict[tuple, NiahBuilder] = {}
        self._tokenizers: dict[str, Tokenizer] = {}

    def tokenizer(self, spec: str) -> Tokenizer:
        if spec not in self._tokenizers:
            self._tokenizers[spec] = get_tokenizer(spec)
        return self._tokenizers[spec]

    def for_source(self, source: ModelSource, settings: ProbeSettings) -> NiahBuilder:
        """The builder of a model's prompts: its tokenizer, the BOS policy and chat template resolved."""
        tokenizer = self.tokenizer(source.tokenizer_spec)
        if tokenizer.vocab_size > source.vocab_size:
            raise SystemExit(
                f"{source.path}: tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} ids but the model "
                f"only {source.vocab_size:,}; pass the model's own tokenizer with --tokenizer"
            )
        chat: tuple[list[int], list[int]] = ([], [])
        if settings.chat_template:
            frame = getattr(tokenizer, "chat_frame", None)
            if frame is None or getattr(tokenizer, "chat_template", None) is None:
                raise SystemExit(
                    f"--chat-template: tokenizer {tokenizer.name} has no chat template "
                    "(tokenizer_config.json's chat_template); leave --chat-template false"
                )
            chat = frame()
        bos = {"always": True, "never": False}.get(settings.bos)
        if bos is None:
            bos = False if settings.chat_template else source.bos_in_training
        fmt = PromptFormat(settings.max_new_tokens, bos, tuple(chat[0]), tuple(chat[1]))
        cache_key = (tokenizer.fingerprint, fmt)
        if cache_key not in self._built:
            self._built[cache_key] = NiahBuilder(tokenizer, self.haystack, fmt)
        return self._built[cache_key]


@dataclass
class Plan:
    """One model's pending work: where its results go, under which key, and which lengths remain."""

    source: ModelSource
    out: Path
    key: str
    parts: dict
    builder: NiahBuilder
    lengths: list[int]
    pending: list[int]


def key_parts(source: ModelSource, builder: NiahBuilder, settings: ProbeSettings) -> dict:
    """What a result is made of: model content, prompt content, decoding settings, code."""
    return {
        "model": source.fingerprint,
        "prompts": builder.digest,
        "decoding": settings.decoding(),
        "code": code_sha256(),
    }


def plan_model(source: ModelSource, out: Path, job: Job, builders: Builders) -> Plan:
    """Claim `out` for this model's key and list the lengths still to probe."""
    builder = builders.for_source(source, job.settings)
    parts = key_parts(source, builder, job.settings)
    key = result_key(parts)
    shortest = builder.min_length()
    lengths = job.lengths_for(source.train_len, shortest)
    if not lengths:
        raise SystemExit(
            f"{source.path} was trained at L = {source.train_len}, below the shortest test tokenizer "
            f"{builder.tokenizer.name} allows with an answer budget of {job.settings.max_new_tokens} "
            f"({shortest} tokens). Fix: train at a longer data.train-len, or pass --lengths from "
            f"{shortest} on (beyond the training length) or a lower --max-new-tokens"
        )
    if min(lengths) < shortest:
        raise SystemExit(
            f"--lengths: {min(lengths)} is below the shortest test this tokenizer and answer budget "
            f"allow ({shortest} tokens); start the lengths there or lower --max-new-tokens"
        )
    if job.settings.teacher_forced:
        answer, _ = reference_answer(
            builder.tokenizer, builder.build(lengths[0], 0, 0), job.settings.answer_order
        )
        if len(answer) > job.settings.max_new_tokens:
            raise SystemExit(
                f"the teacher-forced reference answer takes {len(answer)} tokens of tokenizer "
                f"{builder.tokenizer.name}, more than the answer budget {job.settings.max_new_tokens}. "
                f"Fix: --max-new-tokens {len(answer)} or more, or --teacher-forced false"
            )
    try:
        results.claim(out, key, parts, job.replace_stale)
    except results.StaleResults as err:
        raise SystemExit(f"error: {err}") from None
    done = results.done_lengths(out, key)
    return Plan(source, out, key, parts, builder, lengths, [n for n in lengths if n not in done])


def execute(plans: Sequence[Plan], job: Job) -> None:
    """Probe every pending length of every plan under one progress bar (tests, with an ETA over all of them)."""
    from tqdm.auto import tqdm

    total = sum(len(p.pending) for p in plans) * job.settings.tests_per_length
    if total and job.show_progress:
        print(f"attention: {job.attention}", file=sys.stderr)
    with tqdm(
        total=total,
        unit="test",
        disable=not job.show_progress or total == 0,
        dynamic_ncols=True,
        desc="probe",
    ) as bar:
        for plan in plans:
            if plan.pending:
                model = plan.source.load(job.settings, job.device, job.attention_backend)
                for length in plan.pending:
                    bar.set_postfix_str(f"{plan.source.name} length {length}")
                    probe_length(model, plan, length, job, bar)
                del model
            _write_meta(plan, job)


def probe_length(model: Generator, plan: Plan, length: int, job: Job, bar: Any = None) -> None:
    """Decode, teacher-force and score one length's tests in batches; write its records and marker."""
    s = job.settings
    tests = plan.builder.make_tests(length, s.tests_per_length, s.seed)
    tokenizer = plan.builder.tokenizer
    started = time.perf_counter()
    records: list[dict] = []
    size = job.batch_for(length)
    for start in range(0, len(tests), size):
        batch = tests[start : start + size]
        answers = generate_answers(
            model, tokenizer, batch, job.device, s.precision, s.max_new_tokens, job.prefill_tokens
        )
        tf = (
            teacher_forced(
                model, tokenizer, batch, job.device, s.precision, s.answer_order, job.prefill_tokens
            )
            if s.teacher_forced
            else None
        )
        records += score_tests(batch, answers, tf, plan.key)
        if bar is not None:
            bar.update(len(batch))
    results.write_length(
        plan.out,
        length,
        records,
        {
            "key": plan.key,
            "seconds": time.perf_counter() - started,
            "batch_size": size,
            "prefill_tokens": job.prefill_tokens,
            "device": str(job.device),
            "threads": torch.get_num_threads(),
        },
    )


def _write_meta(plan: Plan, job: Job) -> None:
    """probe.json (provenance) and the trained-length histogram beside the records."""
    source = plan.source
    if source.length_hist is not None:
        np.save(
            plan.out / results.HIST_FILE, source.length_hist.astype(np.int64), allow_pickle=False
        )
    results.write_json(
        plan.out / results.META_FILE,
        {
            "model": source.name,
            "model_path": str(source.path),
            "model_kind": source.kind,
            "key": plan.key,
            "key_parts": plan.parts,
            "settings": asdict(job.settings),
            "lengths": plan.lengths,
            "train_len": source.train_len,
            "tokens_seen": source.tokens_seen,
            "tokens_this_run": source.tokens_this_run,
            "prompt_format": asdict(plan.builder.format),
            "tokenizer": plan.builder.tokenizer.name,
            "haystack": plan.builder.haystack.name,
            "haystack_sha256": plan.builder.haystack.sha256,
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
    derive: bool = True,
) -> list[dict]:
    """Probe models into their result directories and (unless a run merge will) derive each one's tables.

    Returns their effective_length rows, or nothing when `derive` is False.
    """
    plans = [plan_model(s, o, job, builders) for s, o in zip(sources, outs)]
    execute(plans, job)
    return [results.derive_model(p.out, job.analysis, job.figures) for p in plans] if derive else []


def run_out_default(run_dir: Path, first: ModelSource, job: Job, builders: Builders) -> Path:
    """RUNDIR/probe-<scheme>-<key of the settings, prompts and code> (model content is keyed per checkpoint)."""
    parts = key_parts(first, builders.for_source(first, job.settings), job.settings)
    del parts["model"]
    return run_dir / f"probe-{job.settings.positions}-{result_key(parts)[:8]}"


def probe_run(
    run_dir: Path,
    out: Path | None,
    job: Job,
    shard: tuple[int, int] | None = None,
    merge_only: bool = False,
) -> tuple[Path, list[dict]]:
    """Probe every milestone of a run (or shard i of n of them), then (unless sharded) derive the run tables."""
    builders = Builders(job.settings.haystack)
    checkpoints = milestones(run_dir)
    mine = checkpoints if shard is None else checkpoints[shard[0] :: shard[1]]
    sources = {
        p: checkpoint_source(p, job.settings) for p in (mine if shard is not None else checkpoints)
    }
    out = out or run_out_default(run_dir, sources[mine[0]], job, builders)
    rows: list[dict] = []
    if (
        not merge_only
    ):  # a sharded task derives its own checkpoints; otherwise derive_run does, once
        rows = probe_models(
            [sources[p] for p in mine],
            [out / p.name for p in mine],
            job,
            builders,
            derive=shard is not None,
        )
    if shard is not None:
        return out, rows
    keys = {
        p.name: result_key(key_parts(s, builders.for_source(s, job.settings), job.settings))
        for p, s in sources.items()
    }
    meta_path = out / results.META_FILE
    previous = results.read_json(meta_path) if meta_path.is_file() else {}
    results.write_json(
        meta_path,
        {
            **previous,
            "run": str(run_dir.resolve()),
            "checkpoints": keys,
            "settings": asdict(job.settings),
            "code_version": code_version(),
        },
    )
    return out, results.derive_run(out, job.analysis, job.figures)


# ------------------------------------------------------------------ CLI


def build_parser() -> ArgumentParser:
    """`posfreq probe`: the model source, `ProbeSettings`, `Analysis` and how the job runs."""
    parser = command_parser(
        "posfreq probe",
        "4-needle NIAH probe of one checkpoint, of every milestone of a run, or of a Hugging Face model: pass rate "
        "per test length, effective length with a bootstrap interval, f(effective length), teacher-forced needle "
        "scores. Results are keyed by the content of the model, prompts, settings and code: a length already "
        "probed under the same key is never decoded again.",
        config_file=True,
    )
    source = parser.add_argument_group("The model(s) to probe: exactly one of")
    source.add_argument(
        "--checkpoint",
        type=Optional[Path],
        default=None,
        help="One trainer checkpoint or consolidated model directory.",
    )
    source.add_argument(
        "--run",
        type=Optional[Path],
        default=None,
        help="A training run directory: probe every complete milestone RUN/checkpoints/tokens-*/.",
    )
    source.add_argument(
        "--model",
        type=Optional[str],
        default=None,
        help="hf:DIR, a Hugging Face Llama-family model directory.",
    )
    parser.add_argument(
        "--lengths",
        type=Optional[str],
        default=None,
        help="Test lengths n (prompt + answer budget): START:STOP:STEP (STOP included) or a comma "
        "list; null: 128, 256, ... up to the model's training length.",
    )
    parser.add_argument(
        "--out",
        type=Optional[Path],
        default=None,
        help="Output directory; null: runs/probe/<model>-<key> for one model, "
        "RUN/probe-<positions>-<key> for --run (key: a hash of model, prompts, settings and code).",
    )
    parser.add_argument(
        "--replace-stale",
        action="store_true",
        help="Delete results in --out made by other weights, prompts, settings or code (else refuse).",
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="Prompts decoded together, at most."
    )
    parser.add_argument(
        "--batch-tokens",
        type=Union[int, Literal["auto"], None],
        default="auto",
        help="At most this many test tokens decoded together, so long tests go in smaller batches; "
        f"null: batch-size at every length; auto: {CPU_BATCH_TOKENS} on a CPU (8 tests of 1K, 2 of "
        "4K, 1 beyond: a batch of 8 4K-token prompts is only 1.05x one alone per test there, and holds "
        "8 KV caches; see the README's Performance section) and no cap on a GPU.",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=Union[int, Literal["auto"], None],
        default="auto",
        help="At most this many prompt tokens in one forward pass (whole prompts, one at least); "
        f"null: a batch at once; auto: {CPU_PREFILL_TOKENS} on a CPU (1.02x the tests/s of 8 prompts "
        "of 1K at once, 1.27x for 8 of 4K; see the README's Performance section) and null on a GPU.",
    )
    parser.add_argument(
        "--device",
        type=str,
        default="auto",
        help="cpu, cuda, cuda:1, ...; auto: cuda when a GPU is available, else cpu.",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (0: one per core available to this process).",
    )
    parser.add_argument(
        "--attention-backend",
        type=AttentionBackend,
        default="auto",
        help="Varlen attention backend (posfreq.train.attention); auto picks by device and what is "
        "installed.",
    )
    parser.add_argument(
        "--shard",
        type=Optional[str],
        default=None,
        help="With --run: probe checkpoints i, i+n, ... only, as i/n (0-based, e.g. "
        "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT), and write no run tables.",
    )
    parser.add_argument(
        "--merge-only",
        action="store_true",
        help="With --run: only write the run tables and figures from the stored results.",
    )
    parser.add_argument("--no-figures", action="store_true", help="Skip the PNG/PDF figures.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    parser.add_class_arguments(ProbeSettings, nested_key=None, as_group=True)
    parser.add_class_arguments(Analysis, nested_key=None, as_group=True)
    return parser


def from_args(cls: type, args: Namespace, parser: ArgumentParser) -> Any:
    """An instance of the dataclass `cls` from its fields in `args`; a value its checks refuse is a usage error."""
    try:
        return cls(**{f.name: args[f.name] for f in fields(cls)})
    except ValueError as err:
        parser.error(str(err))


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when a GPU is available, else cpu; any other name as torch reads it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, probe, print the effective length(s)."""
    parser = build_parser()
    args = parse(parser, argv)
    if sum(x is not None for x in (args.checkpoint, args.run, args.model)) != 1:
        parser.error("give exactly one of --checkpoint, --run, --model")
    if (args.shard or args.merge_only) and not args.run:
        parser.error("--shard and --merge-only need --run")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0, got {args.threads}")
    try:
        lengths = parse_lengths(args.lengths) if args.lengths else None
        shard = parse_shard(args.shard) if args.shard else None
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    try:
        device = resolve_device(args.device)
        on_cpu = device.type == "cpu"
        batch_tokens = (
            (CPU_BATCH_TOKENS if on_cpu else None)
            if args.batch_tokens == "auto"
            else args.batch_tokens
        )
        prefill_tokens = (
            (CPU_PREFILL_TOKENS if on_cpu else None)
            if args.prefill_tokens == "auto"
            else args.prefill_tokens
        )
        job = Job(
            from_args(ProbeSettings, args, parser),
            lengths,
            args.batch_size,
            device,
            from_args(Analysis, args, parser),
            args.attention_backend,
            not args.no_figures,
            not args.quiet,
            args.replace_stale,
            batch_tokens,
            prefill_tokens,
        )
    except ValueError as err:
        parser.error(str(err))
    settings = job.settings
    if args.run:
        out, rows = probe_run(args.run, args.out, job, shard, args.merge_only)
    else:
        builders = Builders(settings.haystack)
        if args.checkpoint:
            source = checkpoint_source(args.checkpoint, settings)
        else:
            if not args.model.startswith("hf:"):
                raise SystemExit(
                    f"--model expects hf:DIR, got {args.model!r} (use --checkpoint for our checkpoints)"
                )
            source = hf_source(Path(args.model[3:]), settings)
        out = args.out
        if out is None:
            builder = builders.for_source(source, settings)
            out = (
                Path("runs/probe")
                / f"{source.name}-{result_key(key_parts(source, builder, settings))}"
            )
        rows = probe_models([source], [out], job, builders)
    for row in rows:
        status = row["effective_length_status"]
        flag = (
            ""
            if status == "ok"
            else f" ({status}{': undefined' if status == STATUS_NONE_PASSED else ': lower bound'})"
        )
        interval = (
            f" [95% interval {row['effective_length_lo']}-{row['effective_length_hi']}]"
            if row["effective_length_lo"] != ""
            else ""
        )
        print(
            f"{row['checkpoint']}: effective length {row['effective_length']}{flag}{interval}, "
            f"f(effective length) = {row['f_effective_length'] or 'n/a'}"
        )
    print(f"outputs in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
