"""The Trainer: one pretraining run's model, optimizer, sampler and loop, on the processes Fabric launched.

Each step: the next micro-batches, one all-reduce of their totals and the stop flags, backward
and update (or a skip), the metrics row, validation and saves when due. The resolved run
(train/run/resolved.py) has checked everything before this starts.

One optimizer step trains on the next ``global_batch_tokens / L`` rows of the packed stream,
whatever the world size: each rank takes ``micro_batch_rows`` rows per micro-batch and
accumulates ``global rows / (world * micro_batch_rows)`` micro-batches (train/run/geometry.py). The
loss is the sum of the token cross-entropies over all targets of the global batch divided by their
number, so k accumulated micro-batches give the update of one batch k times larger.

MFU = FLOPs of a step (train/run/flops.py: 6 N tokens plus the per-document attention term) / step time
    / (devices * the GPU's peak bf16 FLOP/s, `flops.peak_of_device_name`).
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from posfreq.train.atomic import disk_full
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint import save as checkpoint_save
from posfreq.train.checkpoint.load import verified_on_rank_0
from posfreq.train.checkpoint.retention import reduce_old_milestones
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.data.packing import IGNORE_INDEX, PackedBatch, PackedSampler
from posfreq.train.model.loss import head_returns_loss
from posfreq.train.model.transformer import Transformer
from posfreq.train.run.config import ConfigError, TrainConfig
from posfreq.train.run.control import EXIT_NOT_REQUEUED, StopSignals, requeue, why_not_requeued
from posfreq.train.run.flops import peak_flops, step_flops
from posfreq.train.run.log import LOG, RunLog
from posfreq.train.run.optim import build_optimizer, clip_grad_norm, lr_at
from posfreq.train.run.parallel import (
    default_resharding,
    reshard_all,
    reshard_for_micro_batch,
    synchronize_replicas,
)
from posfreq.train.run.resolved import ResolvedRun
from posfreq.train.run.validation import ValidationBatches, validation_due, validation_loss


class NonFiniteLoss(FloatingPointError):
    """A non-finite loss or gradient norm stopped the run; `main` adds the command that continues at `lower_lr`."""

    def __init__(self, message: str, lower_lr: float) -> None:
        super().__init__(message)
        self.lower_lr = lower_lr


@dataclass(frozen=True)
class StepAgreement:
    """What every rank learns at the start of a step (one all-reduce): the step's totals and the stop flags."""

    n_targets: float
    sum_s_s1: float  # sum over segments of s(s + 1): the attention term of the step's FLOPs
    stop: bool  # a rank received a stop signal
    time_due: bool  # checkpoint.latest_every_minutes have passed on rank 0
    requeue: bool  # the signal was SIGUSR1


class Trainer:
    """One pretraining run on the processes Fabric launched."""

    def __init__(self, cfg: TrainConfig, fabric, run: ResolvedRun, signals: StopSignals) -> None:
        self.cfg, self.fabric, self.run, self.signals = cfg, fabric, run, signals
        self.out = Path(cfg.out)
        self.step = 0
        self.exit_code = (
            0  # EXIT_NOT_REQUEUED once a signal stopped the run and nothing requeued it
        )
        self.checkpoints_written: list[str] = []  # saved by this invocation, for the summary
        self.loss_by_distance: dict | None = (
            None  # this step's validation by distance, for the milestone
        )
        self.val_batches: ValidationBatches | None = (
            None  # built at the first validation, then kept
        )
        self.last_latest_time = time.monotonic()
        # this rank's counts since start/resume
        self.trained_lengths = np.zeros(cfg.data.train_len + 1, dtype=np.int64)
        self.tokens_before = 0  # tokens the initial weights (model.init_from) had been trained on
        self.wall_time = 0.0
        torch.manual_seed(cfg.seed)
        with fabric.init_module(empty_init=False):
            model = Transformer(run.model_config, attention_backend=cfg.model.attention_backend)
        if cfg.model.init_from and run.resume_from is None:
            self._init_from(Path(cfg.model.init_from), model)
        self.model = fabric.setup_module(model)
        synchronize_replicas(self.model)
        self.params = list(self.model.parameters())
        self.optimizer = fabric.setup_optimizers(build_optimizer(self.model, cfg))
        d = cfg.data
        self.sampler = PackedSampler(
            run.dataset,
            d.train_len,
            cfg.micro_batch_rows,
            seed=cfg.seed,
            rank=fabric.global_rank,
            world_size=fabric.world_size,
            packing=d.row_packing(),
        )
        self.peak = peak_flops(fabric.device, cfg.logging.peak_flops_per_device)
        if run.resume_from is not None:
            self._load(run.resume_from)

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def run_tokens(self) -> int:
        """Tokens this run has trained (milestone names and schedules count these)."""
        return self.step * self.cfg.global_batch_tokens

    def _global_lengths(self) -> np.ndarray:
        """The trained-length histogram summed over ranks. On NCCL the sum comes back on the GPU: copied to host."""
        counts = torch.from_numpy(self.trained_lengths.copy())
        return self.fabric.all_reduce(counts, reduce_op="sum").cpu().numpy().astype(np.int64)

    def save(self, final: Path, weights_only: bool = False) -> Path:
        """Save model (+ optimizer), sampler, schedule, RNG and the trained-length histogram."""
        objects = {"model": self.model}
        if not weights_only:
            objects["optimizer"] = self.optimizer
        cfg, run = self.cfg, self.run
        state = {
            "step": self.step,
            "run_tokens": self.run_tokens,
            "tokens_trained": self.tokens_before + self.run_tokens,
            "train_len": cfg.data.train_len,
            "resumable": not weights_only,
            "sharded": cfg.checkpoint.sharded,
            "world_size": self.fabric.world_size,
            "sampler": self.sampler.state_dict(),
            "config": cfg.to_dict(),
            # rank 0 writes this file: no other rank reads every document offset for it
            "data": {
                "dir": cfg.data.dir,
                "fingerprint": run.data_fingerprint if self.fabric.global_rank == 0 else None,
            },
            "schedule": {
                "next_lr": lr_at(self.step, cfg, run.total_steps),
                "total_steps": run.total_steps,
            },
            "wall_time_s": self.wall_time,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        try:
            records = checkpoint_save.RunRecords(
                self._global_lengths(),
                run.model_config,
                run.tokenizer_spec,
                cfg.to_dict(),
                self.loss_by_distance,
            )
            saved = checkpoint_save.save_checkpoint(
                self.fabric, final, objects, state, cfg.checkpoint.sharded, records
            )
        except Exception as err:
            full = disk_full(err, final.parent)
            if full is None:
                raise
            raise CheckpointError(
                f"saving {final} failed: {full} ({type(err).__name__}: {err}). Fix: free space "
                "there, then continue with --resume auto (from the newest complete checkpoint; "
                "the unfinished save is removed at start)"
            ) from err
        self.checkpoints_written.append(saved.name)
        return saved

    def _init_from(self, path: Path, model: Transformer) -> None:
        """Continue from another run's weights (e.g. a warm-up phase), counting its trained lengths too."""
        saved, mine = ckpt.load_model_config(path), self.run.model_config
        if replace(saved, train_len=mine.train_len) != mine:  # L may differ
            raise ConfigError(
                f"model.init_from={path}: its model config {saved} differs from this run's {mine}"
            )
        model.load_state_dict(verified_on_rank_0(path, saved, self.fabric, "model.init_from"))
        source = ckpt.read_trainer_state(path) or {}
        self.tokens_before = int(source.get("tokens_trained", 0))
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
        objects = {"model": self.model, "optimizer": self.optimizer}
        ckpt.load_training_state(self.fabric, path, objects, meta["sharded"])
        try:
            self.sampler.load_state_dict(meta["sampler"])
        except ValueError as err:
            raise CheckpointError(f"resume from {path}: {err}") from None
        self.step = int(meta["step"])
        self.tokens_before = int(meta["tokens_trained"]) - int(meta["run_tokens"])
        self.wall_time = float(meta.get("wall_time_s", 0.0))
        if self.fabric.global_rank == 0:  # the saved histogram is global; others count from zero
            self.trained_lengths = ckpt.load_trained_lengths(path)
        ckpt.restore_rank_rng(path, self.fabric.global_rank)
        LOG.info(f"resumed from {path} at step {self.step} ({self.run_tokens:,} tokens)")

    # -- one optimizer step --------------------------------------------------------------------

    def _agree(self, batches: list[PackedBatch]) -> StepAgreement:
        """Sum the step's targets and attention term over ranks, with the stop and time flags."""
        due = (
            self.cfg.checkpoint.latest_every_minutes > 0
            and time.monotonic() - self.last_latest_time
            >= 60 * self.cfg.checkpoint.latest_every_minutes
        )
        lengths = [np.diff(b.cu_seqlens.numpy()).astype(np.float64) for b in batches]
        local = torch.tensor(
            [
                sum(float((b.targets != IGNORE_INDEX).sum()) for b in batches),
                sum(float((s * (s + 1)).sum()) for s in lengths),
                float(self.signals.received is not None),
                float(due and self.fabric.global_rank == 0),
                float(self.signals.received == signal.SIGUSR1),
            ],
            dtype=torch.float64,
            device=self.fabric.device,
        )
        n, s_s1, stop, time_due, usr1 = self.fabric.all_reduce(local, reduce_op="sum").tolist()
        return StepAgreement(n, s_s1, stop > 0, time_due > 0, usr1 > 0)

    def _train_step(
        self, batches: list[PackedBatch], n_targets: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the micro-batches; returns (summed local loss, grad norm).

        Only the last micro-batch's backward reduces the gradients (`no_backward_sync`), and with several the
        parameters stay gathered from the first forward to that backward (`reshard_for_micro_batch`): one
        all-gather per FSDP2 module and step, however many micro-batches; sharded again after the step."""
        fabric, device = self.fabric, self.fabric.device
        # FSDP averages gradients over ranks; undo that, divide by targets
        scale = fabric.world_size / n_targets
        loss_sum = torch.zeros((), device=device)
        try:
            for i, batch in enumerate(batches):
                batch = batch.to(device, non_blocking=True)
                reshard_for_micro_batch(self.model.module, i, len(batches))
                with fabric.no_backward_sync(self.model, enabled=i < len(batches) - 1):
                    # summed loss, no full logits
                    with head_returns_loss(self.model.lm_head, batch.targets):
                        loss = self.model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen)
                    fabric.backward(loss * scale)
                loss_sum += loss.detach()
        finally:
            default_resharding(self.model.module)
            # Lightning's no-sync context leaves gradient sync off after a step's last micro-batch (its __exit__
            # sets sync to its `enabled`): on again, so no later backward outside the loop skips the reduction
            self.model.module.set_requires_gradient_sync(True)
        return loss_sum, clip_grad_norm(self.params, self.cfg.optim.grad_clip)

    def _optimize(self, batches: list[PackedBatch], n_targets: float) -> dict:
        """Backward and update (unless skipped), count the trained lengths; the step's loss, lr and skip."""
        skip_reason = None
        if n_targets == 0:  # no row of the global batch has a target (e.g. 1-token pieces): no loss
            loss = grad_norm = math.nan
            skip_reason = "no_targets"
        else:
            loss_sum, grad_norm = self._train_step(batches, n_targets)
            loss = float(self.fabric.all_reduce(loss_sum, reduce_op="sum")) / n_targets
            grad_norm = float(grad_norm)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                skip_reason = "non_finite"
                if self.cfg.on_nonfinite == "stop":
                    self._nonfinite(loss, grad_norm)
        lr = lr_at(self.step, self.cfg, self.run.total_steps)
        if skip_reason is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        if skip_reason != "non_finite":  # the histogram counts the segments fed, targets or not
            for batch in batches:
                self.trained_lengths += np.bincount(
                    batch.segment_lengths, minlength=self.cfg.data.train_len + 1
                )
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skip_reason is not None,
            "skip_reason": skip_reason,
        }

    def _nonfinite(self, loss: float, grad_norm: float) -> None:
        # Only a suggestion in a message: sizes, not checksums, so no rank reads gigabytes here.
        resume = ckpt.find_resume_checkpoint(self.out, hashes=False)
        where = f"resume from {resume}" if resume else "no checkpoint exists yet; start again"
        raise NonFiniteLoss(
            f"non-finite loss or gradient norm (loss {loss}, grad norm {grad_norm}) at step {self.step + 1} "
            f"(tokens {self.run_tokens:,}-{self.run_tokens + self.cfg.global_batch_tokens:,}); the weights were "
            f"not updated. To continue: {where} with a lower optim.lr (--resume-override '{{optim.lr: ...}}'), or set "
            "--on-nonfinite skip.",
            lower_lr=self.cfg.optim.lr / 10,
        )

    def _row(self, update: dict, agreed: StepAgreement, elapsed: float) -> dict:
        """The step's metrics row (metrics.jsonl and the console)."""
        flops = step_flops(self.run.model_config, self.cfg.global_batch_tokens, agreed.sum_s_s1)
        peak = self.peak * self.fabric.world_size if self.peak else None
        return {
            "step": self.step,
            "tokens": self.run_tokens,
            **update,
            "step_time_s": elapsed,
            "tokens_per_s": self.cfg.global_batch_tokens / elapsed,
            "flops_per_s": flops / elapsed,
            "mfu": flops / elapsed / peak if peak else None,
        }

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train until total_tokens (or stop_at_step / a signal); returns this run's logged metrics."""
        cfg, fabric, run = self.cfg, self.fabric, self.run
        log = RunLog(
            self.out,
            self.step,
            run.total_steps,
            cfg.logging.every_steps,
            fabric.global_rank == 0,
            cfg.logging.progress_bar,
        )
        history: list[dict] = []
        stop_at = min(run.total_steps, cfg.stop_at_step or run.total_steps)
        signalled = False
        while self.step < stop_at and not signalled:
            started = time.perf_counter()
            batches = [next(self.sampler) for _ in range(run.accumulation)]
            agreed = self._agree(batches)
            update = self._optimize(batches, agreed.n_targets)
            self.step += 1
            if fabric.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            self.wall_time += elapsed
            history.append(self._row(update, agreed, elapsed))
            signalled, last = agreed.stop, self.step == stop_at
            log.step(history[-1], fabric, last=last or signalled)
            self.loss_by_distance = None
            if run.val_dataset is not None and (
                validation_due(cfg, self.run_tokens, self.step == run.total_steps)
                or self._milestone_due()  # every milestone keeps its loss by distance
            ):
                if self.val_batches is None:
                    self.val_batches = ValidationBatches.build(
                        run.val_sampler,
                        cfg.micro_batch_rows,
                        run.val_rows,
                        fabric.world_size,
                        fabric.global_rank,
                    )
                loss, targets, by_distance = validation_loss(self.model, fabric, self.val_batches)
                reshard_all(self.model.module)  # sharded again before a save or the next step
                log.validation(self.step, self.run_tokens, loss, targets, fabric)
                self.loss_by_distance = {
                    "step": self.step,
                    "tokens_trained": self.tokens_before + self.run_tokens,
                    **by_distance.to_dict(),
                }
            saved = self._maybe_save(signalled or last, agreed.time_due)
            if signalled:
                self._stop_on_signal(saved, agreed.requeue)
        finished = "finished" if self.step == run.total_steps else "stop_at_step"
        why = ("signal" if signalled else finished) if history else "nothing_left"
        log.summary(why, self.checkpoints_written)
        log.close()
        for external in fabric.loggers:  # the CSV logger writes its file here
            external.finalize("success")
        return history

    def _maybe_save(self, stopping: bool, time_due: bool) -> Path | None:
        """Save a milestone and/or `latest` if one is due; returns the resumable checkpoint written, if any."""
        c, step = self.cfg.checkpoint, self.step
        root = ckpt.checkpoint_root(self.out)
        tokens = self.run_tokens
        if self._milestone_due():
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

    def _milestone_due(self) -> bool:
        """Whether this step ends at a milestone: every checkpoint.every_tokens tokens, and the run's last step."""
        every, tokens = self.cfg.checkpoint.every_tokens, self.run_tokens
        before = tokens - self.cfg.global_batch_tokens
        return tokens // every > before // every or self.step == self.run.total_steps

    def _reduce_old_milestones(self) -> None:
        """Rank 0 reduces the milestones older than the newest `checkpoint.keep_full` to weights only (disk space)."""
        keep = self.cfg.checkpoint.keep_full
        if keep is None:
            return
        if self.fabric.global_rank == 0:
            for line in reduce_old_milestones(self.out, keep):
                LOG.info(f"checkpoint.keep_full={keep}: {line}")
        self.fabric.barrier()

    def _stop_on_signal(self, saved: Path, usr1: bool) -> None:
        """After the signal's save: requeue the SLURM job if asked and possible, and say what happens next."""
        why_not = why_not_requeued(self.signals.received, usr1, self.cfg)
        job = os.environ.get("SLURM_JOB_ID")
        if why_not is None and self.fabric.global_rank == 0:
            why_not = requeue(job)
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
