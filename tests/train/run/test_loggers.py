"""The trainer's external loggers: one wandb run id per run directory, online only with credentials."""

from __future__ import annotations

import re

import pytest
from helpers.trainer import (
    run,
    tiny,
)

from posfreq.train.run import loggers
from posfreq.train.run.config import config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_wandb_run_id_is_reused_and_mode_follows_credentials(data_dir, tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    cfg = config_from_dict(tiny(data_dir, tmp_path / "run", **{"logging.logger": "wandb"}))
    first = loggers.fabric_loggers(cfg)[0]
    run_id = (tmp_path / "run" / loggers.WANDB_ID_FILE).read_text().strip()
    assert re.fullmatch("[0-9a-f]{8}", run_id)
    assert (
        first._wandb_init["id"] == run_id
        and first._wandb_init["resume"] == "allow"
        and first._offline
    )
    assert (
        loggers.fabric_loggers(cfg)[0]._wandb_init["id"] == run_id
    )  # a requeued job: the same wandb run
    assert (
        f"wandb: offline (no credentials: WANDB_API_KEY is unset and {netrc_file} has no login for "
        f"api.wandb.ai); upload later with `wandb sync {tmp_path / 'run/wandb'}`; run id {run_id}"
    ) in loggers.wandb_report(cfg)
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert loggers.wandb_mode() == (
        False,
        f"{netrc_file} has a login for api.wandb.ai (wandb login)",
    )
    assert not loggers.fabric_loggers(cfg)[0]._offline
    netrc_file.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert loggers.wandb_mode() == (False, "WANDB_API_KEY is set")
    assert loggers.wandb_report(cfg).startswith(
        f"wandb: online (WANDB_API_KEY is set); run id {run_id}"
    )
    monkeypatch.setenv(
        "SLURM_JOB_ID", "4242"
    )  # credentials on a shared home, a node without internet: offline
    offline, why = loggers.wandb_mode()
    assert (
        offline
        and why.startswith("a SLURM job (SLURM_JOB_ID is set)")
        and "WANDB_MODE=online" in why
    )
    monkeypatch.setenv("WANDB_MODE", "online")  # a site whose nodes reach wandb says so
    assert loggers.wandb_mode() == (False, "WANDB_MODE=online is set")
    monkeypatch.setenv(
        "WANDB_MODE", "disabled"
    )  # an explicit choice wins; a whole run with it logs nowhere
    assert loggers.wandb_mode() == (True, "WANDB_MODE=disabled is set")
    run(tiny(data_dir, tmp_path / "run", stop_at_step=1, **{"logging.logger": "wandb"}))
    assert (tmp_path / "run" / loggers.WANDB_ID_FILE).read_text().strip() == run_id
