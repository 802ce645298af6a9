"""Reading a model out of a checkpoint: its weights (verified against the manifest first), its fingerprint, and
what it says about its model without the weights (`CheckpointInfo`).

Every form the layout (train/checkpoint/layout.py) describes is read here: a sharded or full trainer checkpoint, a
weights-only milestone and a consolidated directory, through train/checkpoint/safe_load.py's readers.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posfreq.train.checkpoint.layout import (
    CHECKPOINTS,
    CONSOLIDATED_WEIGHTS,
    DAMAGED_FIX,
    LATEST,
    LENGTHS_FILE,
    MANIFEST_FILE,
    META_FILE,
    MILESTONE_PREFIX,
    MODEL_CONFIG_FILE,
    STATE_DIR,
    STATE_FILE,
    TOKENIZER_FILE,
    TRAINER_FILE,
    load_model_config,
    load_trained_lengths,
    read_checkpoint_json,
    read_trainer_state,
    verify_checkpoint,
    with_token_names,
)
from posfreq.train.checkpoint.safe_load import (
    CheckpointError,
    first_non_finite,
    load_pickled,
    non_finite_message,
    safe_dcp_reader,
)
from posfreq.train.model.config import ModelConfig
from posfreq.train.model.transformer import Transformer

_VERIFIED: set[tuple[str, str]] = set()
"""(checkpoint, manifest sha256) pairs this process has verified: a probe reads a checkpoint's weights twice."""


def verify_before_reading(path: Path) -> None:
    """Check a checkpoint's files against its manifest (sizes, then sha256) before its weights are read, once per
    process: a file damaged on disk fails the probe, an export or a consolidation instead of feeding them. A trainer
    checkpoint's manifest is recorded in trainer.json, a consolidation's in meta.json; one written before manifests
    (or a consolidation before they had their own) has none to check. A checkpoint resealed while it was read (a
    training run's retention reduces old milestones to weights) is checked again under its new manifest."""
    for attempt in range(2):
        meta = read_trainer_state(path)
        if meta is None and (path / MANIFEST_FILE).is_file() and (path / META_FILE).is_file():
            meta = read_checkpoint_json(path / META_FILE, "consolidation record")
        if meta is None or "manifest_sha256" not in meta:
            return
        key = (str(path.resolve()), str(meta["manifest_sha256"]))
        if key in _VERIFIED:
            return
        try:
            verify_checkpoint(path, meta, hashes=True)
        except CheckpointError as err:
            now = read_trainer_state(path) or {}
            if attempt == 0 and now.get("manifest_sha256") not in (None, meta["manifest_sha256"]):
                continue  # replaced meanwhile, not damaged
            raise CheckpointError(f"{err}. {DAMAGED_FIX}") from None
        _VERIFIED.add(key)
        return


def model_state_dict(
    checkpoint_dir: str | Path, config: ModelConfig | None = None, verified: bool = False
) -> dict[str, torch.Tensor]:
    """Plain (CPU, full) model state_dict from a consolidated dir or a full/sharded trainer checkpoint, its files
    verified against the checkpoint's manifest first (`verified`: another process of the job has just done so)."""
    path = Path(checkpoint_dir)
    config = config or load_model_config(path)
    if not verified:
        verify_before_reading(path)
    if (path / CONSOLIDATED_WEIGHTS).is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path / CONSOLIDATED_WEIGHTS))
        except SafetensorError as err:
            raise CheckpointError(
                f"{path / CONSOLIDATED_WEIGHTS}: not a readable safetensors file ({err}). {DAMAGED_FIX}"
            ) from None
    if (path / STATE_FILE).is_file():
        return load_pickled(path / STATE_FILE, mmap=True)["model"]
    if (path / STATE_DIR / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        with torch.device("meta"):
            shapes = {k: (v.shape, v.dtype) for k, v in Transformer(config).state_dict().items()}
        state = {
            "model": {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
        }
        with (
            warnings.catch_warnings()
        ):  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(state, storage_reader=safe_dcp_reader(path / STATE_DIR), no_dist=True)
            except CheckpointException as err:  # a BaseException: `except Exception` never sees it
                reason = str(err).strip().splitlines()[-1][:300]
                raise CheckpointError(
                    f"{path / STATE_DIR}: cannot be read ({reason}). {DAMAGED_FIX}"
                ) from None
        return state["model"]
    raise FileNotFoundError(
        f"{path}: no {CONSOLIDATED_WEIGHTS}, {STATE_FILE} or {STATE_DIR}/.metadata. Pass a checkpoint "
        f"directory (OUT/{CHECKPOINTS}/tokens-*/ or latest/) or a consolidated model directory."
    )


def verified_on_rank_0(
    path: Path, config: ModelConfig, fabric: Any, what: str
) -> dict[str, torch.Tensor]:
    """The model state_dict of `path` on every rank of a job, its checksums read by rank 0 alone (a whole
    checkpoint, optimizer included) while the others wait for its verdict; CheckpointError prefixed with `what`."""
    damage = None
    if fabric.global_rank == 0:
        try:
            verify_before_reading(path)
        except CheckpointError as err:
            damage = f"{what}: {err}"
    damage = fabric.broadcast(damage, src=0)
    if damage:
        raise CheckpointError(damage)
    return model_state_dict(path, config, verified=True)


def run_record(path: Path) -> Path:
    """The file holding a checkpoint's run state: a consolidation's meta.json (a copy of its source's), else
    trainer.json."""
    return path / (META_FILE if (path / META_FILE).is_file() else TRAINER_FILE)


def load_model(
    checkpoint_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> tuple[Transformer, dict, dict]:
    """(model in eval mode, tokenizer spec, meta) from a consolidated dir or any trainer checkpoint.

    The tokenizer spec is {"spec", "vocab_size", "bos_id", "eos_id"} (`get_tokenizer(spec["spec"])`);
    meta is trainer.json (or meta.json of a consolidated dir): step, run_tokens, tokens_trained, config, ...
    """
    path = Path(checkpoint_dir)
    config = load_model_config(path)
    tokenizer = read_checkpoint_json(path / TOKENIZER_FILE, "tokenizer spec")
    meta_file = run_record(path)
    meta = (
        with_token_names(read_checkpoint_json(meta_file, "run state"))
        if meta_file.is_file()
        else {}
    )
    state = model_state_dict(path, config)
    found = first_non_finite(state.items())
    if found:
        raise CheckpointError(non_finite_message(str(path), found))
    with torch.device("meta"):
        model = Transformer(config, attention_backend=attention_backend)
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_positions("rope")  # rebuild the rotary tables off the meta device
    model.to(device=device, dtype=dtype)
    return model.eval(), tokenizer, meta


def model_fingerprint(checkpoint_dir: str | Path) -> str:
    """sha256 of a checkpoint's model: its config and tokenizer spec files and its weight tensors.

    The weights are hashed as loaded (name, dtype, shape, bytes), not as files, so the optimizer
    state beside them in a trainer checkpoint does not count: a full milestone, its weights-only
    reduction (`checkpoint.keep_full`) and a consolidation in the same dtype share one fingerprint,
    and probe results made on one are found for the others.
    """
    path = Path(checkpoint_dir)
    digest = hashlib.sha256()
    for name in (MODEL_CONFIG_FILE, TOKENIZER_FILE):
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\n")
    state = model_state_dict(path)
    for key in sorted(state):
        tensor = state[key].detach().contiguous().reshape(-1)
        digest.update(f"{key}\0{tensor.dtype}\0{tuple(state[key].shape)}\n".encode())
        digest.update(memoryview(tensor.view(torch.uint8).numpy()))
    return digest.hexdigest()


def check_checkpoint_tokenizer(
    path: str | Path, spec: str | None, fingerprint: str | None, override: str | None = None
) -> None:
    """CheckpointError unless the tokenizer a reader of checkpoint `path` will use (`override`, else the `spec` it
    recorded) is, by content, the one its run trained with (`fingerprint`; a built-in and its exported files count
    as one), where the run recorded it: other token ids would read nonsense. A recorded hf:DIR that is gone (the
    run's folders moved) gets the override as its fix. Nothing is loaded when there is nothing to check."""
    from posfreq.train.data.hf_tokenizer import same_tokenizer
    from posfreq.train.data.tokenizer import get_tokenizer, hf_dir

    if override is None and spec is not None:
        directory = hf_dir(spec)
        if directory is not None and not directory.exists():
            raise CheckpointError(
                f"{path} trained with the tokenizer {spec}, which is not there now (moved or deleted). Fix: pass "
                "--tokenizer hf:<its new folder> (checked against the content the run recorded), or restore "
                "the folder"
            )
    used = override or spec
    if fingerprint is None or used is None:
        return  # a run from before fingerprints: nothing to check against
    try:
        tokenizer = get_tokenizer(used)
    except (ValueError, ImportError, FileNotFoundError) as err:
        raise CheckpointError(f"{path}: the tokenizer {used} does not load here: {err}") from None
    if same_tokenizer(fingerprint, tokenizer):
        return
    if override is None:
        raise CheckpointError(
            f"{path}: its tokenizer {spec} is not, by content, the one the run trained with (content "
            f"{tokenizer.fingerprint} now, {fingerprint} then): replaced or edited since. Fix: restore it, or pass "
            "--tokenizer SPEC naming the one it trained with"
        )
    raise CheckpointError(
        f"--tokenizer {override} is not, by content, the tokenizer {path} trained with ({spec}: content "
        f"{tokenizer.fingerprint} here, {fingerprint} then), so its token ids would not be the model's. Fix: pass "
        "the tokenizer the run trained with, or drop --tokenizer"
    )


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint (trainer milestone or consolidated directory) says about its model, read without weights."""

    path: Path
    config: ModelConfig
    tokenizer_spec: str | None
    """tokenizer_spec.json's "spec"; None if the file is absent."""
    bos_in_training: bool
    """tokenizer_spec.json's "bos_in_training"; False if absent."""
    tokenizer_fingerprint: str | None
    """tokenizer_spec.json's "fingerprint", the tokenizer's content when the run trained; None if absent."""
    trained_lengths: np.ndarray | None
    """trained_lengths.npy; None if absent."""
    run_tokens: int | None
    """Tokens this checkpoint's own run trained (trainer.json, else meta.json); None if neither says."""
    tokens_trained: int | None
    """Every token the weights saw: the run's plus its warm-up's (model.init_from); None if unknown."""
    fingerprint: str
    """`model_fingerprint(path)`."""


def _token_counts(path: Path) -> tuple[int | None, int | None]:
    """(run_tokens, tokens_trained) from trainer.json, else meta.json; (None, None) if neither says."""
    for name in (TRAINER_FILE, META_FILE):
        if (path / name).is_file():
            meta = with_token_names(read_checkpoint_json(path / name, "run state"))
            if meta.get("run_tokens") is not None:
                run_tokens = int(meta["run_tokens"])
                return run_tokens, int(meta.get("tokens_trained", run_tokens))
    return None, None


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """The config, tokenizer, trained lengths, token counts and fingerprint of one checkpoint directory.

    Raises CheckpointError naming the path and the fix when it holds no model_config.json.
    """
    path = Path(path)
    if not (path / MODEL_CONFIG_FILE).is_file():
        what = (
            "does not exist" if not path.exists() else "is not a checkpoint (no model_config.json)"
        )
        raise CheckpointError(
            f"{path} {what}. Fix: pass RUN/{CHECKPOINTS}/{MILESTONE_PREFIX}*/ (or {LATEST}/) or a "
            "consolidated model directory"
        )
    spec_file = path / TOKENIZER_FILE
    spec = read_checkpoint_json(spec_file, "tokenizer spec") if spec_file.is_file() else {}
    hist_file = path / LENGTHS_FILE
    run_tokens, tokens_trained = _token_counts(path)
    return CheckpointInfo(
        path=path,
        config=load_model_config(path),
        tokenizer_spec=spec.get("spec"),
        bos_in_training=bool(spec.get("bos_in_training", False)),
        tokenizer_fingerprint=spec.get("fingerprint"),
        trained_lengths=load_trained_lengths(path) if hist_file.is_file() else None,
        run_tokens=run_tokens,
        tokens_trained=tokens_trained,
        fingerprint=model_fingerprint(path),
    )
