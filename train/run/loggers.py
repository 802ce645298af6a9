"""The trainer's external loggers for Lightning Fabric: a CSV file, or wandb (its run id per run directory and
whether it runs online, from the credentials wandb itself would find)."""

from __future__ import annotations

import netrc
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlparse

from posfreq.train.journal import record_written
from posfreq.train.run.config import TrainConfig

WANDB_ID_FILE = "wandb_run_id"  # in OUT: the wandb run every job of this run directory logs to


def wandb_run_id(out: Path) -> str:
    """The wandb run id of run directory `out`, created once (the first process to link its file wins), so every
    job of the run, requeued ones included, logs to the same wandb run."""
    path = out / WANDB_ID_FILE
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        record_written(path)
        # the host too: two nodes' ranks can share a pid, and one's unlink must not take the other's file
        mine = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
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
    """(offline, why): WANDB_MODE when set; else offline in a SLURM job (compute nodes often have no outbound
    internet, and wandb.init then times out at the first log, which --kill-on-bad-exit turns into a dead job);
    else offline only when wandb would find no credentials (WANDB_API_KEY, or its netrc login)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"] != "online", f"WANDB_MODE={os.environ['WANDB_MODE']} is set"
    if os.environ.get("SLURM_JOB_ID"):
        return True, (
            "a SLURM job (SLURM_JOB_ID is set), where compute nodes often cannot reach wandb; WANDB_MODE=online "
            "logs live where they can"
        )
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


def fabric_loggers(cfg: TrainConfig) -> list:
    """The Fabric loggers `logging.logger` asks for (none, CSV in OUT/csv, or wandb)."""
    out = Path(cfg.out)
    if cfg.logging.logger == "csv":
        from lightning.fabric.loggers import CSVLogger

        return [CSVLogger(str(out), name="csv")]
    if cfg.logging.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # A fresh run (--overwrite) gets a fresh wandb run: rank 0 records its id under the run lock (`run_control.overwrite_run`).
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


def wandb_report(cfg: TrainConfig) -> str:
    """One line: the wandb mode and why, and the run id a requeued job resumes."""
    offline, why = wandb_mode()
    out = Path(cfg.out)
    sync = f"; upload later with `wandb sync {out / 'wandb'}`" if offline else ""
    return (
        f"wandb: {'offline' if offline else 'online'} ({why}){sync}; run id {wandb_run_id(out)} "
        f"(from {out / WANDB_ID_FILE}: every job of this run directory resumes it)"
    )
