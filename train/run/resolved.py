"""The resolved run: a run config checked against its data, model and resume point before any compute.

Everything a user can get wrong (data, model, batch geometry, a resume from another config or
other documents, a fresh start over an existing run) raises a ConfigError or CheckpointError
naming the key or file and the fix, before processes launch. The exceptions read gigabytes: a resume
checkpoint's checksums and the data fingerprint it is compared with (resume on other documents), checked once by
rank 0 after launch (`agree_on_resume`), not by every rank.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.data.packing_schedule import some_document_has_weight
from posfreq.train.data.tokenizer import get_tokenizer, hf_dir
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.data.upsample import LengthUpsample
from posfreq.train.outdir import OutputDirError
from posfreq.train.run.config import ConfigError, TrainConfig
from posfreq.train.run.control import check_run_dir, run_files
from posfreq.train.run.geometry import batch_geometry, resolve_model_config
from posfreq.train.run.optim import lr_at
from posfreq.train.run.resume_changes import config_differences, overridden_changes
from posfreq.train.run.validation import validation_rows, validation_sampler


class ResolvedRun:
    """The resolved run: model config, batch geometry, schedule length, resume point; all validated."""

    def __init__(
        self,
        cfg: TrainConfig,
        world_size: int,
        hashes: bool = True,
        chosen: Path | None = None,
    ) -> None:
        """`hashes=False` checks a checkpoint's file sizes only (`checksum_verdict` then checks the rest, once);
        `chosen` is the checkpoint that verdict settled on, resumed without checking again."""
        self.cfg = cfg
        self.world_size = world_size
        self.hashes = hashes
        self.chosen = chosen
        try:
            check_run_dir(cfg)
        except OutputDirError as err:
            raise ConfigError(str(err)) from err
        if not cfg.data.dir:
            raise ConfigError(
                "data.dir is empty. Fix: set --data.dir to a directory written by posfreq prepare"
            )
        try:
            self.dataset = TokenDataset(cfg.data.dir, tokenizer=cfg.data.tokenizer)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"data.dir: {err}") from err
        if self.dataset.num_tokens == 0:
            raise ConfigError(
                f"data.dir {cfg.data.dir} holds no tokens. Fix: re-run posfreq prepare"
            )
        self.val_dataset = self._validation_data(cfg)
        self.val_sampler = (
            None if self.val_dataset is None else validation_sampler(self.val_dataset, cfg)
        )
        self.val_rows = self._validation_rows(cfg)
        self._check_upsample(cfg)
        self.model_config = resolve_model_config(cfg, self.dataset.vocab_size)
        if self.model_config.vocab_size < self.dataset.vocab_size:
            raise ConfigError(
                f"model vocab_size {self.model_config.vocab_size} < the data's {self.dataset.vocab_size} "
                f"({self.dataset.tokenizer}). Fix: drop model.overrides.vocab_size."
            )
        geometry = batch_geometry(cfg, world_size)
        self.global_rows, self.accumulation = geometry.global_rows, geometry.accumulation
        self.total_steps = geometry.total_steps
        self.tokenizer_spec = self._tokenizer_spec()
        self.skipped: list[
            str
        ] = []  # checkpoints `--resume auto` passed over, each with the reason
        self.schedule_change: str | None = None  # what --resume_override changed, for the report
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

    @functools.cached_property
    def data_fingerprint(self) -> str:
        """The training shards' fingerprint (`TokenDataset.fingerprint`: every document offset read), computed
        where it is needed: by rank 0 alone once processes run (to check a resume, to write a checkpoint), not by
        each of a cluster job's ranks at every start."""
        return self.dataset.fingerprint()

    def _validation_rows(self, cfg: TrainConfig) -> int:
        """The rows each validation scores (`validation_rows`); ConfigError when data.val_dir holds not one."""
        if self.val_sampler is None:
            return 0
        rows = validation_rows(self.val_sampler, cfg.data.val_rows)
        if rows == 0:
            raise ConfigError(
                f"data.val_dir {cfg.data.val_dir} holds {self.val_dataset.num_tokens} tokens, not one validation "
                f"row of {cfg.data.val_len or cfg.data.train_len} ({cfg.data.packing} packing). Fix: hold out "
                "more documents (posfreq prepare --val-fraction), a shorter data.val_len, or data.val_dir null"
            )
        return rows

    def _tokenizer_spec(self) -> dict:
        """What checkpoints record of the data's tokenizer: its spec, ids and, where it loads here, its content
        fingerprint; ConfigError for an hf:DIR the shards name that is gone (the data or the folder moved)."""
        directory = hf_dir(self.dataset.tokenizer)
        # a folder, or its tokenizer.json named itself
        if directory is not None and not directory.exists():
            raise ConfigError(
                f"data.dir {self.cfg.data.dir}: its shards were tokenized with {self.dataset.tokenizer}, which "
                "is not there now (moved or deleted), so checkpoints could not name a tokenizer to probe with. "
                "Fix: rerun posfreq prepare with the same corpus, flags (--val-fraction, source filters) and --out "
                "and --tokenizer hf:<its new folder> (the shards are kept; they record the new path), or restore "
                "the folder"
            )
        spec = {
            "spec": self.dataset.tokenizer,
            "vocab_size": self.dataset.vocab_size,
            "eos_id": self.dataset.eos_id,
        }
        try:
            tokenizer = get_tokenizer(self.dataset.tokenizer)
        except (ValueError, ImportError, FileNotFoundError):
            spec["bos_id"] = (
                None  # a tokenizer registered only in another process (e.g. the demo's)
            )
            return spec
        # Its absolute spec (an hf:DIR the shards recorded relative to where prepare ran is resolved here)
        # and its content: the probe and export refuse a tokenizer whose files changed since.
        spec.update(spec=tokenizer.name, bos_id=tokenizer.bos_id, fingerprint=tokenizer.fingerprint)
        return spec

    def _auto_resume_point(self, hashes: bool) -> Path | None:
        """The newest checkpoint that verifies; None for a fresh run; an error if checkpoints exist but none verify."""
        path, self.skipped = ckpt.choose_resume_checkpoint(self.cfg.out, hashes)
        if path is None and self.skipped:
            raise CheckpointError(
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
        if self.chosen is not None:
            path = self.chosen
        else:
            path = (
                self._auto_resume_point(self.hashes) if cfg.resume == "auto" else Path(cfg.resume)
            )
        if path is None:
            return None
        if not path.exists():
            raise ConfigError(
                f"resume={cfg.resume}: no checkpoint directory {path}. Fix: --resume null to start afresh (the "
                "YAML spelling of none), --resume auto, or a checkpoint directory such as OUT/checkpoints/latest"
            )
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
        if cfg.resume != "auto" and self.chosen is None:  # `auto` verified it while choosing
            self._verify_chosen(path, meta, self.hashes)
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
        if self.hashes:  # else rank 0 checks it after launch (`checksum_verdict`), for every rank
            self._check_same_data(path, meta)
        if meta["sharded"] != cfg.checkpoint.sharded:
            raise ConfigError(
                f"resume: {path} is {'sharded' if meta['sharded'] else 'a full file'}; set "
                f"--checkpoint.sharded {str(meta['sharded']).lower()} to load it"
            )
        # Fabric reads it through DCP's unrestricted unpickler. Without hashes, after `checksum_verdict`:
        # a damaged pickle is then a reason to fall back to an older checkpoint, not an error.
        if self.hashes:
            ckpt.verify_resume_files(path)
        return path

    def checksum_verdict(self) -> dict:
        """Rank 0's check of the checksums this run skipped (`hashes=False`): {"resume_from", "skipped"}, where
        resume_from may be an older checkpoint under --resume auto, or {"error": what every rank raises}. Never
        raises: the other ranks wait for this answer."""
        if self.resume_from is None:
            return {"resume_from": None, "skipped": self.skipped}
        try:
            if self.cfg.resume == "auto":
                path = self._auto_resume_point(hashes=True)
                if path is None:
                    raise CheckpointError(
                        f"resume=auto: the checkpoints under {ckpt.checkpoint_root(self.cfg.out)} "
                        "found before launch are gone (another job's retention?). Fix: make sure one "
                        "job runs in this --out, then resubmit"
                    )
            else:
                path = self.resume_from
                meta = ckpt.read_trainer_state(path)
                if meta is None:
                    raise CheckpointError(f"resume={self.cfg.resume}: {path} is no longer complete")
                self._verify_chosen(path, meta, hashes=True)
            self._check_same_data(path, ckpt.read_trainer_state(path) or {})
        except (CheckpointError, ConfigError) as err:
            return {"error": str(err)}
        except Exception as err:  # e.g. an I/O error on the damaged disk a checksum exists to catch
            return {"error": f"checking {self.resume_from}: {type(err).__name__}: {err}"}
        return {"resume_from": str(path), "skipped": self.skipped}

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
        linked = [p.name for p in run_files(out) if p.is_symlink()]
        if self.cfg.overwrite and linked:
            raise ConfigError(
                f"--overwrite: {', '.join(str(out / n) for n in linked)} is a link, and posfreq never deletes "
                "through a link. Fix: empty what it points to yourself and start with --resume null, or use "
                "another --out (nothing was changed)"
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

    def _verify_chosen(self, path: Path, meta: dict, hashes: bool) -> None:
        """Check the files of the checkpoint named by --resume PATH against its manifest."""
        try:
            ckpt.verify_checkpoint(path, meta, hashes)
        except CheckpointError as err:
            raise CheckpointError(
                f"resume={self.cfg.resume}: {err}. Fix: restore a good copy of it, or use "
                "--resume auto (the newest checkpoint whose files verify)."
            ) from None

    def _check_same_data(self, path: Path, meta: dict) -> None:
        """Refuse to resume on other documents than the checkpoint's, even with equal document and token counts."""
        saved = meta.get("data")
        if (
            saved is None or saved["fingerprint"] == self.data_fingerprint
        ):  # None: before fingerprints
            return
        raise ConfigError(
            f"resume: {path} was trained on data.dir {saved['dir']} (data fingerprint {saved['fingerprint'][:16]}), "
            f"but data.dir {self.cfg.data.dir} holds other documents (fingerprint {self.data_fingerprint[:16]}): "
            "shard names, file sizes or document offsets differ. Fix: set --data.dir to the data this run was "
            "trained on (a copy of its shard files is fine), or start a new run in a new --out directory."
        )


def agree_on_resume(run: ResolvedRun, fabric) -> ResolvedRun:
    """After launch: rank 0 alone reads the checkpoint every rank chose by file sizes, to check its checksums (not
    every rank, each reading gigabytes of the same files); every rank then resumes what rank 0 found good (an
    older checkpoint if the newest is damaged, under --resume auto) or raises rank 0's error. Whatever goes wrong on
    one rank afterwards is raised on every rank, never left for the others to wait on."""
    verdict = fabric.broadcast(run.checksum_verdict() if fabric.global_rank == 0 else None, src=0)
    if "error" in verdict:
        raise CheckpointError(verdict["error"])
    chosen = verdict["resume_from"]
    problem = None
    try:
        if chosen is None and run.resume_from is not None:
            raise CheckpointError(
                f"rank {fabric.global_rank} found checkpoint {run.resume_from} but rank 0 found none to "
                "resume: the nodes see the run directory differently"
            )
        if chosen is not None and Path(chosen) != run.resume_from:
            run = ResolvedRun(run.cfg, run.world_size, hashes=False, chosen=Path(chosen))
        run.skipped = verdict["skipped"]
        if run.resume_from is not None:
            ckpt.verify_resume_files(run.resume_from)  # every rank: each loads its part through DCP
    except Exception as err:  # any error: the other ranks must hear of it, not wait in all_reduce
        problem = err
    failed = fabric.all_reduce(
        torch.tensor(float(problem is not None), device=fabric.device), reduce_op="sum"
    )
    if problem is not None:
        raise problem
    if float(failed) > 0:
        raise CheckpointError(
            f"{int(failed)} rank(s) could not take the checkpoint rank 0 chose ({chosen}); their logs say "
            "why. Fix: check that every node sees --out alike (a network file system), then resubmit"
        )
    return run
