"""Pretraining entry point: Lightning Fabric + FSDP2, checkpoints every N tokens, exact resume.

Run ``posfreq pretrain --config configs/pretrain_2k.yaml [--section.key value ...]``
(``--help`` lists every key). One code path on CPU (gloo) and GPU (NCCL): Fabric's
`ModelParallelStrategy` with a parallelize function that applies FSDP2 (`fully_shard` on each
block and the root; bf16 compute with fp32 weights and gradient reduction under
``precision: bf16-mixed``; optional activation checkpointing).

One optimizer step trains on the next ``global_batch_tokens / L`` rows of the packed stream,
whatever the world size: each rank takes ``micro_batch_rows`` rows per micro-batch and
accumulates ``global rows / (world * micro_batch_rows)`` micro-batches. The loss is the sum of
the token cross-entropies over all targets of the global batch divided by their number, so k
accumulated micro-batches give the update of one batch k times larger.

MFU = FLOPs of a step (train/flops.py: 6 N tokens plus the per-document attention term) / step time
    / (devices * the GPU's peak bf16 FLOP/s, `flops.peak_of_device_name`).

Signals and exit codes: SIGUSR1 and SIGTERM are caught from the start of `train` on, so one that
arrives while the run starts up is not fatal; the step after it ends with a save. After SIGUSR1
in a SLURM job (with ``requeue_on_signal``) the trainer runs ``scontrol requeue`` and exits 0.
Otherwise nothing restarts the run, and after the save it exits with code 3
(``EXIT_NOT_REQUEUED``), saying the job was not requeued; continue it with ``--resume auto``.
Errors a user can fix (config, checkpoint, a run directory locked by another job, a non-finite
loss) print ``error: ...`` naming the key or file and the fix, and exit 1; after a non-finite loss
the fix is the exact command that continues with a lower LR (``--resume-override "{optim.lr: ...}"``).
"""

from __future__ import annotations

import math
import netrc
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

import numpy as np
import torch
from torch import nn

from posfreq.train import checkpoint as ckpt
from posfreq.train import run_config
from posfreq.train.atomic import disk_full
from posfreq.train.attention import BackendError, explain_backend
from posfreq.train.config import model_preset
from posfreq.train.flops import matmul_params, peak_of_device_name, step_flops  # noqa: F401 (re-exported)
from posfreq.train.loss import head_returns_loss
from posfreq.train.model import Transformer
from posfreq.train.packing import IGNORE_INDEX, PackedBatch, PackedSampler
from posfreq.train.packing_plan import some_document_has_weight
from posfreq.train.run_config import (
    ConfigError,
    TrainConfig,
    config_differences,
    overridden_changes,
    parse_args,
)
from posfreq.train.run_lock import RunLock, RunLockError
from posfreq.train.run_log import LOG, RunLog, start_console
from posfreq.train.shards import DamagedShard, TokenDataset
from posfreq.train.tokenizer import get_tokenizer
from posfreq.train.upsample import LengthUpsample

EXIT_NOT_REQUEUED = 3  # a signal stopped the run after a save, and no SLURM requeue will restart it
STOP_SIGNALS = (
    signal.SIGUSR1,
    signal.SIGTERM,
    signal.SIGINT,
)  # SIGINT: Ctrl-C saves `latest` as SIGTERM does
WANDB_ID_FILE = "wandb_run_id"  # in OUT: the wandb run every job of this run directory logs to


# --------------------------------------------------------------------------------------------
# Pure pieces: schedule, FLOPs, parallelization, optimizer
# --------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr, cosine to min_lr."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    decay_steps = o.decay_steps or total_steps
    if step >= decay_steps:
        return o.min_lr
    ratio = (step - o.warmup_steps) / max(1, decay_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Peak FLOP/s of one device: the config value, else a known GPU's dense bf16 peak, else None."""
    if override:
        return override
    if device.type == "cuda":
        return peak_of_device_name(torch.cuda.get_device_name(device))
    return None


def _checkpointed(block: nn.Module) -> None:
    """Make a block recompute its activations in backward (keeps parameter names unchanged)."""
    forward = block.forward

    def run(x, ctx, cache=None):
        return torch.utils.checkpoint.checkpoint(forward, x, ctx, cache, use_reentrant=False)

    block.forward = run


def make_parallelize(mixed_precision: bool, activation_checkpointing: bool):
    """Fabric parallelize_fn: FSDP2 `fully_shard` on every block, then on the root."""

    def parallelize(model: Transformer, mesh) -> Transformer:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = mesh["data_parallel"]
        # cast_forward_inputs=False: FSDP2 would rebuild every dataclass among a block's inputs to cast its tensors
        # (the ForwardContext, its scheme and Rotary: a crash on Rotary's init=False memo, and bf16 RoPE frequencies).
        # The blocks' activations are bf16 anyway: they come from the bf16 embedding.
        policy = (
            MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        for i, block in enumerate(model.layers):
            if activation_checkpointing:
                _checkpointed(block)
            # The last block's parameters are needed again at once by backward: keep them gathered.
            fully_shard(
                block,
                mesh=dp_mesh,
                mp_policy=policy,
                reshard_after_forward=i < len(model.layers) - 1,
            )
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        return model

    return parallelize


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on all parameters (TinyLlama) or on 2-D non-embedding weights only."""
    o = cfg.optim
    if o.weight_decay_scope == "all":
        groups = [{"params": list(model.parameters()), "weight_decay": o.weight_decay}]
    else:
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 gradient norm over (possibly sharded DTensor) grads; clips in place if max_norm > 0."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


# --------------------------------------------------------------------------------------------
# Plan: everything checked before compute
# --------------------------------------------------------------------------------------------


class Plan:
    """The resolved run: model config, batch geometry, schedule length, resume point; all validated."""

    def __init__(self, cfg: TrainConfig, world_size: int) -> None:
        self.cfg = cfg
        self.world_size = world_size
        if not cfg.data.dir:
            raise ConfigError(
                "data.dir is empty. Fix: set --data.dir to a directory written by scripts/prepare_data.py"
            )
        try:
            self.dataset = TokenDataset(cfg.data.dir, tokenizer=cfg.data.tokenizer)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"data.dir: {err}") from err
        if self.dataset.num_tokens == 0:
            raise ConfigError(
                f"data.dir {cfg.data.dir} holds no tokens. Fix: re-run scripts/prepare_data.py"
            )
        self.data_fingerprint = self.dataset.fingerprint()
        self.val_dataset = self._validation_data(cfg)
        self._check_upsample(cfg)
        overrides = dict(cfg.model.overrides)
        overrides.setdefault("vocab_size", self.dataset.vocab_size)
        # The checkpoint records the length it was trained at: STRING and the baselines derive their
        # defaults (e.g. S = L/3) from it at inference.
        overrides["train_len"] = cfg.data.train_len
        try:
            self.model_config = model_preset(cfg.model.preset, **overrides)
        except ValueError as err:
            raise ConfigError(f"model: {err}") from err
        if self.model_config.vocab_size < self.dataset.vocab_size:
            raise ConfigError(
                f"model vocab_size {self.model_config.vocab_size} < the data's {self.dataset.vocab_size} "
                f"({self.dataset.tokenizer}). Fix: drop model.overrides.vocab_size."
            )
        L = cfg.data.train_len
        rows_per_micro = cfg.micro_batch_rows * world_size
        if cfg.global_batch_tokens % L or (cfg.global_batch_tokens // L) % rows_per_micro:
            raise ConfigError(
                f"global_batch_tokens={cfg.global_batch_tokens} is not a whole number of micro-batches of "
                f"micro_batch_rows={cfg.micro_batch_rows} x train_len={L} x world_size={world_size} = "
                f"{rows_per_micro * L} tokens. Fix: make global_batch_tokens a multiple of {rows_per_micro * L}."
            )
        self.global_rows = cfg.global_batch_tokens // L
        self.accumulation = self.global_rows // rows_per_micro
        self.total_steps = -(-cfg.total_tokens // cfg.global_batch_tokens)
        self.tokenizer_spec = self._tokenizer_spec()
        self.skipped: list[
            str
        ] = []  # checkpoints `--resume auto` passed over, each with the reason
        self.schedule_change: str | None = (
            None  # what --resume_override changed, for the start-up report
        )
        self.resume_from = self._resume_point()

    def _check_upsample(self, cfg: TrainConfig) -> None:
        """Refuse length weights that give the corpus's documents no expected copy at all (every epoch empty)."""
        weights = LengthUpsample.parse(cfg.data.length_upsample, where="data.length_upsample")
        if weights and not some_document_has_weight(self.dataset, weights):
            raise ConfigError(
                f"data.length_upsample={cfg.data.length_upsample} gives every document of data.dir "
                f"{cfg.data.dir} weight 0: no epoch would hold a token. Fix: give some lengths a weight."
            )

    def _validation_data(self, cfg: TrainConfig) -> TokenDataset | None:
        """The held-out shards of data.val_dir (same tokenizer as the training shards), or None."""
        if not cfg.data.val_dir:
            return None
        try:
            val = TokenDataset(cfg.data.val_dir, tokenizer=self.dataset.tokenizer)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"data.val_dir: {err}") from err
        if val.num_tokens == 0:
            raise ConfigError(
                f"data.val_dir {cfg.data.val_dir} holds no tokens. Fix: point it at held-out shards "
                "(posfreq prepare --val-fraction writes them) or set it to null"
            )
        return val

    def _tokenizer_spec(self) -> dict:
        spec = {
            "spec": self.dataset.tokenizer,
            "vocab_size": self.dataset.vocab_size,
            "eos_id": self.dataset.eos_id,
        }
        try:
            spec["bos_id"] = get_tokenizer(self.dataset.tokenizer).bos_id
        except (ValueError, ImportError, FileNotFoundError):
            spec["bos_id"] = (
                None  # a tokenizer registered only in another process (e.g. the demo's)
            )
        return spec

    def _auto_resume_point(self) -> Path | None:
        """The newest checkpoint that verifies; None for a fresh run; an error if checkpoints exist but none verify."""
        path, self.skipped = ckpt.choose_resume_checkpoint(self.cfg.out)
        if path is None and self.skipped:
            raise ckpt.CheckpointError(
                f"resume=auto: no checkpoint under {ckpt.checkpoint_root(self.cfg.out)} can be resumed:\n  "
                + "\n  ".join(self.skipped)
                + "\nFix: restore a good copy of one of them, or pass --resume PATH to "
                "a checkpoint you trust; to start over, use a new --out (nothing was deleted)."
            )
        return path

    def _resume_point(self) -> Path | None:
        cfg = self.cfg
        if cfg.overwrite and cfg.resume is not None:
            raise ConfigError(
                f"--overwrite starts afresh, --resume {cfg.resume} continues: choose one "
                "(--resume null --overwrite, or --resume auto without --overwrite)"
            )
        if cfg.resume is None:
            self._refuse_restart_over_a_run()
            return None
        path = self._auto_resume_point() if cfg.resume == "auto" else Path(cfg.resume)
        if path is None:
            return None
        meta = ckpt.read_trainer_state(path)
        if meta is None:
            raise ConfigError(
                f"resume={cfg.resume}: {path} is not a complete checkpoint (no valid trainer.json + state)"
            )
        if not meta.get("resumable"):
            raise ConfigError(
                f"resume: {path} holds model weights only (checkpoint.milestone_weights_only, or "
                "reduced by checkpoint.keep_full); resume from a full checkpoint such as "
                "OUT/checkpoints/latest"
            )
        if cfg.resume != "auto":  # `auto` verified it while choosing
            self._verify_chosen(path, meta)
        diffs = config_differences(meta["config"], cfg.to_dict())
        saved_model = ckpt.load_model_config(path)
        if saved_model != self.model_config:
            diffs.append(
                f"model config: checkpoint {saved_model.to_dict()} vs now {self.model_config.to_dict()}"
            )
        if diffs:
            raise ConfigError(
                f"resume: {path} was written by a different config:\n  "
                + "\n  ".join(diffs)
                + "\nFix: resume with the original config, or start a new run in a new --out directory."
            )
        changes = overridden_changes(meta["config"], cfg.to_dict())
        if changes:
            self.schedule_change = self._schedule_change(meta, changes)
        self._check_same_data(path, meta)
        if meta["sharded"] != cfg.checkpoint.sharded:
            raise ConfigError(
                f"resume: {path} is {'sharded' if meta['sharded'] else 'a full file'}; set "
                f"--checkpoint.sharded {str(meta['sharded']).lower()} to load it"
            )
        ckpt.verify_resume_files(path)  # Fabric reads it through DCP's unrestricted unpickler
        return path

    def _refuse_restart_over_a_run(self) -> None:
        """A fresh start (resume null) into a directory that holds a run would mix two runs' logs and checkpoints."""
        out = Path(self.cfg.out)
        held = [p.name for p in run_files(out) if p.exists()]
        init = Path(self.cfg.model.init_from).resolve() if self.cfg.model.init_from else None
        if (
            self.cfg.overwrite
            and init is not None
            and any(init.is_relative_to(p.resolve()) for p in run_files(out))
        ):
            raise ConfigError(
                f"model.init_from={self.cfg.model.init_from} lies in the run files --overwrite would "
                "delete. Fix: copy that checkpoint elsewhere first, or use another --out"
            )
        if held and not self.cfg.overwrite:
            raise ConfigError(
                f"--out {out} holds a run ({', '.join(held)}) and --resume is null (start afresh). "
                "Fix: --resume auto to continue it, a new --out to start another run, or --overwrite "
                "to delete that run's files and start afresh (nothing was changed)."
            )

    def _schedule_change(self, meta: dict, changes: list[str]) -> str:
        """The overridden keys and the schedule from the resumed step on, before and after (next LR, total steps)."""
        step, old = int(meta["step"]), meta["schedule"]
        return (
            f"resume_override: {'; '.join(changes)}; schedule from step {step}: next LR {old['next_lr']:.6g} -> "
            f"{lr_at(step, self.cfg, self.total_steps):.6g}, total steps {old['total_steps']:,} -> "
            f"{self.total_steps:,}"
        )

    def _verify_chosen(self, path: Path, meta: dict) -> None:
        """Check the files of the checkpoint named by --resume PATH against its manifest."""
        try:
            ckpt.verify_checkpoint(path, meta)
        except ckpt.CheckpointError as err:
            raise ckpt.CheckpointError(
                f"resume={self.cfg.resume}: {err}. Fix: restore a good copy of it, or use "
                "--resume auto (the newest checkpoint whose files verify)."
            ) from None

    def _check_same_data(self, path: Path, meta: dict) -> None:
        """Refuse to resume on other documents than the checkpoint's, even with equal document and token counts."""
        saved = meta.get("data")
        if (
            saved is None or saved["fingerprint"] == self.data_fingerprint
        ):  # None: saved before fingerprints
            return
        raise ConfigError(
            f"resume: {path} was trained on data.dir {saved['dir']} (data fingerprint {saved['fingerprint'][:16]}), "
            f"but data.dir {self.cfg.data.dir} holds other documents (fingerprint {self.data_fingerprint[:16]}): "
            "shard names, file sizes or document offsets differ. Fix: set --data.dir to the data this run was "
            "trained on (a copy of its shard files is fine), or start a new run in a new --out directory."
        )


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


class NonFiniteLoss(FloatingPointError):
    """A non-finite loss or gradient norm stopped the run; `main` adds the command that continues at `lower_lr`."""

    def __init__(self, message: str, lower_lr: float) -> None:
        super().__init__(message)
        self.lower_lr = lower_lr


class StopSignals:
    """Records SIGUSR1 / SIGTERM / SIGINT from start-up on (Python's default would end the process), for the loop
    to act on: the run saves `latest` and stops. A second Ctrl-C stops at once, saving nothing."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous = {signum: signal.signal(signum, self._record) for signum in STOP_SIGNALS}

    def _record(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            print(
                "\nCtrl-C: saving checkpoints/latest after this step (Ctrl-C again stops without saving)",
                file=sys.stderr,
                flush=True,
            )
        self.received = signum

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class Trainer:
    """One pretraining run on the processes Fabric launched."""

    def __init__(self, cfg: TrainConfig, fabric, plan: Plan, signals: StopSignals) -> None:
        self.cfg, self.fabric, self.plan, self.signals = cfg, fabric, plan, signals
        self.out = Path(cfg.out)
        self.step = 0
        self.exit_code = (
            0  # EXIT_NOT_REQUEUED once a signal stopped the run and nothing requeued it
        )
        self.checkpoints_written: list[
            str
        ] = []  # names of the checkpoints this invocation saved, for the summary
        self.last_latest_time = time.monotonic()
        self.trained_lengths = np.zeros(
            cfg.data.train_len + 1, dtype=np.int64
        )  # this rank's counts since start/resume
        self.tokens_before = (
            0  # tokens the initial weights (model.init_from) had already been trained on
        )
        self.wall_time = 0.0
        torch.manual_seed(cfg.seed)
        with fabric.init_module(empty_init=False):
            model = Transformer(plan.model_config, attention_backend=cfg.model.attention_backend)
        if cfg.model.init_from and plan.resume_from is None:
            self._init_from(Path(cfg.model.init_from), model)
        self.model = fabric.setup_module(model)
        self.params = list(self.model.parameters())
        self.optimizer = fabric.setup_optimizers(build_optimizer(self.model, cfg))
        d = cfg.data
        self.sampler = PackedSampler(
            plan.dataset,
            d.train_len,
            cfg.micro_batch_rows,
            seed=cfg.seed,
            rank=fabric.global_rank,
            world_size=fabric.world_size,
            packing=d.packing,
            attention=d.attention,
            shuffle=d.shuffle,
            shuffle_block=d.shuffle_block,
            upsample=d.length_upsample,
        )
        self.peak = peak_flops(fabric.device, cfg.logging.peak_flops_per_device)
        if plan.resume_from is not None:
            self._load(plan.resume_from)

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def tokens_seen(self) -> int:
        return self.step * self.cfg.global_batch_tokens

    def _global_lengths(self) -> np.ndarray:
        """The trained-length histogram summed over ranks. On NCCL the sum comes back on the GPU: copied to host."""
        counts = torch.from_numpy(self.trained_lengths.copy())
        return self.fabric.all_reduce(counts, reduce_op="sum").cpu().numpy().astype(np.int64)

    def save(self, final: Path, weights_only: bool = False) -> Path:
        """Save model (+ optimizer), sampler, schedule, RNG and the trained-length histogram."""
        objects = (
            {"model": self.model}
            if weights_only
            else {"model": self.model, "optimizer": self.optimizer}
        )
        files = {
            "trained_lengths.npy": self._global_lengths(),
            "model_config.json": self.plan.model_config.to_dict(),
            "tokenizer_spec.json": self.plan.tokenizer_spec,
            "config.json": self.cfg.to_dict(),
        }
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "tokens_before": self.tokens_before,
            "train_len": self.cfg.data.train_len,
            "resumable": not weights_only,
            "sharded": self.cfg.checkpoint.sharded,
            "world_size": self.fabric.world_size,
            "sampler": self.sampler.state_dict(),
            "config": self.cfg.to_dict(),
            "data": {"dir": self.cfg.data.dir, "fingerprint": self.plan.data_fingerprint},
            "schedule": {
                "next_lr": lr_at(self.step, self.cfg, self.plan.total_steps),
                "total_steps": self.plan.total_steps,
            },
            "wall_time_s": self.wall_time,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        try:
            saved = ckpt.save_checkpoint(
                self.fabric, final, objects, files, state, self.cfg.checkpoint.sharded
            )
        except Exception as err:
            full = disk_full(err, final.parent)
            if full is None:
                raise
            raise ckpt.CheckpointError(
                f"saving {final} failed: {full} ({type(err).__name__}: {err}). Fix: free space "
                "there, then continue with --resume auto (from the newest complete checkpoint; "
                "the unfinished save is removed at start)"
            ) from err
        self.checkpoints_written.append(saved.name)
        return saved

    def _init_from(self, path: Path, model: Transformer) -> None:
        """Continue from another run's weights (e.g. a warm-up phase), counting its trained lengths too."""
        saved = ckpt.load_model_config(path)
        if (
            replace(saved, train_len=self.plan.model_config.train_len) != self.plan.model_config
        ):  # L may differ
            raise ConfigError(
                f"model.init_from={path}: its model config {saved} differs from this run's "
                f"{self.plan.model_config}"
            )
        model.load_state_dict(ckpt.model_state_dict(path, saved))
        source = ckpt.read_trainer_state(path) or {}
        self.tokens_before = int(source.get("tokens_seen", 0)) + int(source.get("tokens_before", 0))
        lengths = ckpt.load_trained_lengths(path)
        if lengths[self.cfg.data.train_len + 1 :].any():
            raise ConfigError(
                f"model.init_from={path} trained segments longer than data.train_len="
                f"{self.cfg.data.train_len}; start from a run with a training length <= this one's"
            )
        if self.fabric.global_rank == 0:  # a global histogram, counted once
            n = min(len(lengths), len(self.trained_lengths))
            self.trained_lengths[:n] += lengths[:n]
        LOG.info(f"initialised from {path} ({int(lengths.sum()):,} trained segments carried over)")

    def _load(self, path: Path) -> None:
        meta = ckpt.read_trainer_state(path)
        state_path = path / ("state" if meta["sharded"] else "state.pt")
        self.fabric.load(
            state_path, {"model": self.model, "optimizer": self.optimizer}, weights_only=True
        )
        try:
            self.sampler.load_state_dict(meta["sampler"])
        except ValueError as err:
            raise ckpt.CheckpointError(f"resume from {path}: {err}") from None
        self.step = int(meta["step"])
        self.tokens_before = int(meta.get("tokens_before", 0))
        self.wall_time = float(meta.get("wall_time_s", 0.0))
        if (
            self.fabric.global_rank == 0
        ):  # the saved histogram is global; other ranks count on from zero
            self.trained_lengths = ckpt.load_trained_lengths(path)
        rng = ckpt.rng_file(path, self.fabric.global_rank)
        if rng.is_file():
            ckpt.restore_rng(ckpt.load_pickled(rng))
        LOG.info(f"resumed from {path} at step {self.step} ({self.tokens_seen:,} tokens)")

    # -- one optimizer step --------------------------------------------------------------------

    def _train_step(
        self, batches: list[PackedBatch], n_targets: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the micro-batches; returns (summed local loss, grad norm)."""
        fabric, device = self.fabric, self.fabric.device
        scale = (
            fabric.world_size / n_targets
        )  # FSDP averages gradients over ranks; undo that, divide by targets
        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            batch = batch.to(device, non_blocking=True)
            with fabric.no_backward_sync(self.model, enabled=i < len(batches) - 1):
                with head_returns_loss(
                    self.model.lm_head, batch.targets
                ):  # summed loss, no full logits
                    loss = self.model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen)
                fabric.backward(loss * scale)
            loss_sum += loss.detach()
        return loss_sum, clip_grad_norm(self.params, self.cfg.optim.grad_clip)

    def _nonfinite(self, loss: float, grad_norm: float) -> None:
        resume = ckpt.find_resume_checkpoint(self.out)
        where = f"resume from {resume}" if resume else "no checkpoint exists yet; start again"
        raise NonFiniteLoss(
            f"non-finite loss or gradient norm (loss {loss}, grad norm {grad_norm}) at step {self.step + 1} "
            f"(tokens {self.tokens_seen:,}-{self.tokens_seen + self.cfg.global_batch_tokens:,}); the weights were "
            f"not updated. To continue: {where} with a lower optim.lr (--resume-override '{{optim.lr: ...}}'), or set "
            "--on-nonfinite skip.",
            lower_lr=self.cfg.optim.lr / 10,
        )

    def validate(self) -> tuple[float, int]:
        """(mean token loss, targets) over the first data.val_rows rows of the held-out shards, split over ranks.

        The same rows every time and for any world size (no shuffle, its own sampler), so values compare across
        steps and runs; the training stream, the RNG and the model's mode are left as they were.
        """
        cfg, fabric = self.cfg, self.fabric
        micro, total = cfg.micro_batch_rows, cfg.data.val_rows
        sampler = PackedSampler(
            self.plan.val_dataset,
            cfg.data.train_len,
            micro,
            seed=0,
            packing=cfg.data.packing,
            attention=cfg.data.attention,
            shuffle=False,
        )
        totals = torch.zeros(2, dtype=torch.float64, device=fabric.device)
        self.model.eval()
        with torch.no_grad():
            for step in range(
                -(-total // (fabric.world_size * micro))
            ):  # the same count on every rank (FSDP)
                first = (step * fabric.world_size + fabric.global_rank) * micro
                rows = min(micro, total - first)
                batch = sampler.make_batch(first if rows > 0 else 0, max(rows, 1)).to(fabric.device)
                with head_returns_loss(self.model.lm_head, batch.targets):
                    loss = self.model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen).double()
                if (
                    rows > 0
                ):  # a rank past the last row still runs the forward its peers' collectives need
                    totals += torch.stack([loss, (batch.targets != IGNORE_INDEX).sum().double()])
        self.model.train()
        loss_sum, targets = fabric.all_reduce(totals, reduce_op="sum").tolist()
        return loss_sum / max(targets, 1.0), int(targets)

    def _validation_due(self) -> bool:
        """Validate after this step: every data.val_every_tokens tokens, and at the last step of the run."""
        if self.plan.val_dataset is None:
            return False
        every, tokens = self.cfg.data.val_every_tokens, self.tokens_seen
        crossed = every > 0 and tokens // every > (tokens - self.cfg.global_batch_tokens) // every
        return crossed or self.step == self.plan.total_steps

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train until total_tokens (or stop_at_step / a signal); returns this run's logged metrics."""
        cfg, fabric, plan = self.cfg, self.fabric, self.plan
        log = RunLog(
            self.out,
            self.step,
            plan.total_steps,
            cfg.logging.every_steps,
            fabric.global_rank == 0,
            cfg.logging.progress_bar,
        )
        history: list[dict] = []
        stop_at = min(plan.total_steps, cfg.stop_at_step or plan.total_steps)
        while self.step < stop_at:
            started = time.perf_counter()
            batches = [next(self.sampler) for _ in range(plan.accumulation)]
            lengths = [np.diff(b.cu_seqlens.numpy()).astype(np.float64) for b in batches]
            due = (
                cfg.checkpoint.latest_every_minutes > 0
                and time.monotonic() - self.last_latest_time
                >= 60 * cfg.checkpoint.latest_every_minutes
            )
            local = torch.tensor(
                [
                    sum(float((b.targets != IGNORE_INDEX).sum()) for b in batches),
                    sum(float((s * (s + 1)).sum()) for s in lengths),
                    float(self.signals.received is not None),
                    float(due and fabric.global_rank == 0),
                    float(self.signals.received == signal.SIGUSR1),
                ],
                dtype=torch.float64,
                device=fabric.device,
            )
            n_targets, sum_s_s1, stop_flag, time_flag, requeue_flag = fabric.all_reduce(
                local, reduce_op="sum"
            ).tolist()
            skip_reason = None
            if (
                n_targets == 0
            ):  # no row of the global batch has a target (e.g. one 1-token piece per row): no loss
                loss = grad_norm = math.nan
                skip_reason = "no_targets"
            else:
                loss_sum, grad_norm = self._train_step(batches, n_targets)
                loss = float(fabric.all_reduce(loss_sum, reduce_op="sum")) / n_targets
                grad_norm = float(grad_norm)
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    skip_reason = "non_finite"
                    if cfg.on_nonfinite == "stop":
                        self._nonfinite(loss, grad_norm)
            lr = lr_at(self.step, cfg, plan.total_steps)
            if skip_reason is None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
            if (
                skip_reason != "non_finite"
            ):  # the histogram counts the segments fed, targets or not (as in any step)
                for batch in batches:
                    self.trained_lengths += np.bincount(
                        batch.segment_lengths, minlength=cfg.data.train_len + 1
                    )
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            if fabric.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            self.wall_time += elapsed
            flops = step_flops(plan.model_config, cfg.global_batch_tokens, sum_s_s1)
            row = {
                "step": self.step,
                "tokens": self.tokens_seen,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "skipped": skip_reason is not None,
                "skip_reason": skip_reason,
                "step_time_s": elapsed,
                "tokens_per_s": cfg.global_batch_tokens / elapsed,
                "flops_per_s": flops / elapsed,
                "mfu": flops / elapsed / (self.peak * fabric.world_size) if self.peak else None,
            }
            history.append(row)
            log.step(row, fabric, last=self.step == stop_at or stop_flag > 0)
            if self._validation_due():
                log.validation(self.step, self.tokens_seen, *self.validate(), fabric)
            saved = self._maybe_save(stop_flag > 0 or self.step == stop_at, time_flag > 0)
            if stop_flag > 0:
                self._stop_on_signal(saved, requeue_flag > 0)
                break
        why = (
            (
                "signal"
                if stop_flag > 0
                else "finished"
                if self.step == plan.total_steps
                else "stop_at_step"
            )
            if history
            else "nothing_left"
        )
        log.summary(why, self.checkpoints_written)
        log.close()
        for external in fabric.loggers:  # the CSV logger writes its file here
            external.finalize("success")
        return history

    def _maybe_save(self, stopping: bool, time_due: bool) -> Path | None:
        """Save a milestone and/or `latest` if one is due; returns the resumable checkpoint written, if any."""
        c, step = self.cfg.checkpoint, self.step
        root = ckpt.checkpoint_root(self.out)
        tokens, before = self.tokens_seen, self.tokens_seen - self.cfg.global_batch_tokens
        milestone = (
            tokens // c.every_tokens > before // c.every_tokens or step == self.plan.total_steps
        )
        if milestone:
            saved = self.save(
                root / ckpt.milestone_name(tokens), weights_only=c.milestone_weights_only
            )
            if not c.milestone_weights_only:
                self._reduce_old_milestones()
                self.last_latest_time = time.monotonic()
                return saved
        if stopping or time_due or (c.latest_every_steps and step % c.latest_every_steps == 0):
            self.last_latest_time = time.monotonic()
            return self.save(root / ckpt.LATEST)
        return None

    def _reduce_old_milestones(self) -> None:
        """Rank 0 reduces the milestones older than the newest `checkpoint.keep_full` to weights only (disk space)."""
        keep = self.cfg.checkpoint.keep_full
        if keep is None:
            return
        if self.fabric.global_rank == 0:
            for line in ckpt.reduce_old_milestones(self.out, keep):
                LOG.info(f"checkpoint.keep_full={keep}: {line}")
        self.fabric.barrier()

    def _stop_on_signal(self, saved: Path, usr1: bool) -> None:
        """After the signal's save: requeue the SLURM job if asked and possible, and say what happens next."""
        job = os.environ.get("SLURM_JOB_ID")
        why_not = (
            "stopped by Ctrl-C"
            if self.signals.received == signal.SIGINT
            else "only SIGUSR1 requeues"
            if not usr1
            else "no SLURM job (SLURM_JOB_ID unset)"
            if not job
            else "requeue_on_signal is false"
            if not self.cfg.requeue_on_signal
            else "--overwrite is set: a requeued job would delete this run again"
            if self.cfg.overwrite
            else None
        )
        if why_not is None and self.fabric.global_rank == 0:
            why_not = _requeue(job)
        if self.fabric.broadcast(why_not is None, src=0):
            LOG.info(
                f"signal received: saved {saved} at step {self.step}; requeued SLURM job {job}"
            )
        else:
            self.exit_code = EXIT_NOT_REQUEUED
            LOG.info(
                f"signal received: saved {saved} at step {self.step}; the job was NOT requeued "
                f"({why_not}): exiting with code {EXIT_NOT_REQUEUED}. Continue with --resume auto."
            )


def _requeue(job: str) -> str | None:
    """`scontrol requeue JOB`; None if it worked, else why not."""
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, check=False
        )
    except OSError as err:
        return f"scontrol requeue {job} could not run: {err}"
    return (
        None
        if proc.returncode == 0
        else f"scontrol requeue {job} failed: {(proc.stderr or '').strip()}"
    )


def wandb_run_id(out: Path) -> str:
    """The wandb run id of run directory `out`, created once (the first process to link its file wins), so every
    job of the run, requeued ones included, logs to the same wandb run."""
    path = out / WANDB_ID_FILE
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        mine = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        mine.write_text(secrets.token_hex(4) + "\n")
        try:
            os.link(mine, path)  # atomic and exclusive: never a half-written or overwritten id
        except FileExistsError:
            pass
        finally:
            mine.unlink()
    return path.read_text().strip()


def _netrc_file() -> Path:
    """The netrc file wandb keeps its login in: $NETRC, else ~/.netrc, else ~/_netrc when only that exists."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    unix, windows = Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()
    return windows if windows.is_file() and not unix.is_file() else unix


def wandb_mode() -> tuple[bool, str]:
    """(offline, why): offline only when wandb would find no credentials (WANDB_API_KEY, or its netrc login) or
    WANDB_MODE asks for it."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"] != "online", f"WANDB_MODE={os.environ['WANDB_MODE']} is set"
    if os.environ.get("WANDB_API_KEY"):
        return False, "WANDB_API_KEY is set"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    file = _netrc_file()
    try:
        if netrc.netrc(file).authenticators(host):
            return False, f"{file} has a login for {host} (wandb login)"
    except (OSError, netrc.NetrcParseError):
        pass
    return True, f"no credentials: WANDB_API_KEY is unset and {file} has no login for {host}"


def _loggers(cfg: TrainConfig) -> list:
    out = Path(cfg.out)
    if cfg.logging.logger == "csv":
        from lightning.fabric.loggers import CSVLogger

        return [CSVLogger(str(out), name="csv")]
    if cfg.logging.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # A fresh run (--overwrite) gets a fresh wandb run: rank 0 records its id under the run lock (`_overwrite`).
        run_id = secrets.token_hex(4) if cfg.overwrite else wandb_run_id(out)
        return [
            WandbLogger(
                project=cfg.logging.project,
                name=cfg.logging.run_name,
                save_dir=str(out),
                offline=wandb_mode()[0],
                id=run_id,
                resume="allow",
                config=cfg.to_dict(),
            )
        ]
    return []


def _wandb_report(cfg: TrainConfig) -> str:
    """One line: the wandb mode and why, and the run id a requeued job resumes."""
    offline, why = wandb_mode()
    out = Path(cfg.out)
    sync = f"; upload later with `wandb sync {out / 'wandb'}`" if offline else ""
    return (
        f"wandb: {'offline' if offline else 'online'} ({why}){sync}; run id {wandb_run_id(out)} "
        f"(from {out / WANDB_ID_FILE}: every job of this run directory resumes it)"
    )


def resolved_accelerator(cfg: TrainConfig) -> str:
    """`cpu` or `cuda`: the config's accelerator, `auto` meaning cuda when a GPU is visible."""
    return (
        cfg.accelerator
        if cfg.accelerator != "auto"
        else ("cuda" if torch.cuda.is_available() else "cpu")
    )


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype attention sees: bf16 parameters under FSDP2's bf16-mixed policy, float32 under 32-true."""
    return torch.bfloat16 if precision == "bf16-mixed" else torch.float32


def attention_choice(cfg: TrainConfig) -> str:
    """The attention backend this run trains with and why, checked before launch (ConfigError if it cannot run)."""
    try:
        _, why = explain_backend(
            cfg.model.attention_backend,
            resolved_accelerator(cfg),
            compute_dtype(cfg.precision),
            backward=True,
        )
    except BackendError as err:
        raise ConfigError(f"model.attention_backend: {err}") from None
    return f"attention: {why}"


def build_fabric(cfg: TrainConfig):
    """Fabric with ModelParallelStrategy(FSDP2) for this config (not yet launched)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    accelerator = resolved_accelerator(cfg)
    devices = (
        cfg.devices
        if cfg.devices != "auto"
        else (torch.cuda.device_count() if accelerator == "cuda" else 1)
    )
    world = int(devices) * cfg.num_nodes
    mixed = cfg.precision == "bf16-mixed"
    strategy = ModelParallelStrategy(
        make_parallelize(mixed, cfg.model.activation_checkpointing),
        data_parallel_size=world,
        tensor_parallel_size=1,
        save_distributed_checkpoint=cfg.checkpoint.sharded,
    )
    return Fabric(
        accelerator=accelerator,
        devices=devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        precision="32-true",
        loggers=_loggers(cfg),
    )


def _lock_run_dir(cfg: TrainConfig, fabric) -> RunLock | None:
    """Rank 0 takes OUT's run lock (the lock it returns); every rank raises RunLockError if it could not."""
    lock, refusal = None, None
    if fabric.global_rank == 0:
        try:
            lock = RunLock.acquire(cfg.out)
        except RunLockError as err:
            refusal = str(err)
    refusal = fabric.broadcast(refusal, src=0)
    if refusal:
        raise RunLockError(refusal)
    return lock


def run_files(out: Path) -> list[Path]:
    """What a pretraining run writes into its OUT (all that --overwrite deletes; the run lock aside)."""
    return [
        ckpt.checkpoint_root(out),
        out / "metrics.jsonl",
        out / "metrics.jsonl.unreadable",
        out / "csv",
    ]


def _overwrite(out: Path, fabric) -> None:
    """Delete the trainer's own files in OUT (--overwrite with resume null; this job holds the lock), and record
    the new wandb run's id."""
    import shutil

    from posfreq.train.atomic import write_text_atomic

    for external in fabric.loggers:
        if type(external).__name__ == "WandbLogger":
            write_text_atomic(out / WANDB_ID_FILE, f"{external.version}\n")
    for path in run_files(out):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        LOG.info(f"--overwrite: deleted {path}")


def _start(cfg: TrainConfig, fabric, plan: Plan, attention: str) -> None:
    """Rank 0: clear interrupted writes (safe: this job holds the lock) and report the run and its resume point."""
    if cfg.overwrite:
        _overwrite(Path(cfg.out), fabric)
    for path in ckpt.remove_stale_temporaries(cfg.out):
        LOG.info(f"removed an interrupted checkpoint write: {path}")
    for reason in plan.skipped:
        LOG.info(f"skipped checkpoint {reason}")
    if plan.schedule_change:
        LOG.info(plan.schedule_change)
    if cfg.logging.logger == "wandb":
        LOG.info(_wandb_report(cfg))
    LOG.info(attention)
    LOG.info(
        f"{plan.model_config.num_params():,} parameters; {fabric.world_size} processes x "
        f"{plan.accumulation} micro-batches x {cfg.micro_batch_rows} rows x {cfg.data.train_len} tokens "
        f"= {cfg.global_batch_tokens:,} tokens/step; {plan.total_steps:,} steps"
    )


def train(cfg: TrainConfig) -> list[dict]:
    """Validate, launch processes, train; returns the logged metrics of this process's run.

    Raises SystemExit(EXIT_NOT_REQUEUED) when a signal stopped the run and no SLURM requeue follows.
    """
    signals = StopSignals()  # before the slow start-up (opening shards, verifying checkpoints)
    lock = None
    try:
        fabric = build_fabric(cfg)
        plan = Plan(cfg, fabric.world_size)  # every check before any process or compute starts
        attention = attention_choice(cfg)
        fabric.launch()
        start_console(fabric.global_rank == 0)
        lock = _lock_run_dir(cfg, fabric)
        if cfg.overwrite and fabric.broadcast(signals.received is not None, src=0):
            raise ConfigError(
                "a stop signal (Ctrl-C, SIGTERM) arrived during start-up; --overwrite deleted nothing"
            )
        if fabric.global_rank == 0:
            _start(cfg, fabric, plan, attention)
        fabric.barrier()
        trainer = Trainer(cfg, fabric, plan, signals)
        history = trainer.fit()
        if trainer.exit_code:
            sys.exit(trainer.exit_code)
        return history
    finally:
        if lock is not None:
            lock.release()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        signals.restore()


def continue_command(argv: list[str], lr: float) -> str:
    """The command that continues this invocation from its newest checkpoint (or afresh) with learning rate `lr`."""
    return shlex.join(
        [
            "posfreq",
            "pretrain",
            *argv,
            "--resume",
            "auto",
            "--resume-override",
            f"{{optim.lr: {lr:g}}}",
        ]
    )


def build_parser():
    """`posfreq pretrain`'s parser: the run config's (a --config YAML plus one flag per TrainConfig field)."""
    return run_config.build_parser()


def main(argv: list[str] | None = None) -> int:
    """The command line: run `train`, printing `error: ...` (exit 1) for a config, checkpoint or lock error, or a
    non-finite loss (with the command that continues the run at a lower LR)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        train(parse_args(argv))
        return 0
    except (ConfigError, ckpt.CheckpointError, RunLockError, DamagedShard) as err:
        sys.exit(f"error: {err}")
    except NonFiniteLoss as err:
        sys.exit(f"error: {err} Command: {continue_command(argv, err.lower_lr)}")
    except KeyboardInterrupt:
        print(
            "interrupted by a second Ctrl-C: nothing saved since the last checkpoint; continue with --resume auto",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
