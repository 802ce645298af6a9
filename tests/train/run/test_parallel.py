"""Where a run executes: the attention backend is checked before launch and named at start (train/run/parallel.py)."""

from __future__ import annotations

import os

import pytest
from helpers.trainer import (
    run,
    tiny,
)

from posfreq.train.run.config import ConfigError, config_from_dict
from posfreq.train.run.parallel import (
    SRUN_TASK,
    attention_choice,
    build_fabric,
    local_launch_env,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_attention_backend_is_checked_before_launch_and_named_at_start(
    data_dir, tmp_path, monkeypatch, capsys
):
    import posfreq.train.model.attention_kernels as attention_kernels

    monkeypatch.setattr(
        attention_kernels, "kernel_present", lambda name: True
    )  # as on a GPU node with everything built
    gpu = {"accelerator": "cuda", "model.attention_backend": "auto"}
    assert attention_choice(
        config_from_dict(tiny(data_dir, tmp_path, **gpu, precision="bf16-mixed"))
    ).startswith("attention: auto -> varlen (cuda, bfloat16, backward")
    fp32 = config_from_dict(tiny(data_dir, tmp_path, **gpu, precision="32-true"))
    assert "auto -> sdpa" in attention_choice(fp32)  # no FlashAttention kernel takes float32
    for backend in ("flash", "varlen"):
        with pytest.raises(
            ConfigError,
            match=f"model.attention_backend: attention backend '{backend}' .*float32.*"
            "Fix: choose 'sdpa'",
        ):
            attention_choice(
                config_from_dict(
                    tiny(
                        data_dir,
                        tmp_path,
                        **{**gpu, "model.attention_backend": backend},
                        precision="32-true",
                    )
                )
            )
    monkeypatch.undo()
    run(tiny(data_dir, tmp_path / "cpu", stop_at_step=1, **{"model.attention_backend": "auto"}))
    assert "attention: auto -> sdpa (cpu, float32, backward)" in capsys.readouterr().out


def test_a_task_of_our_srun_line_is_a_slurm_rank_even_in_an_allocation_named_bash(
    data_dir, tmp_path, monkeypatch
):
    """In an salloc shell (job name bash), Lightning's own detection takes an srun task for a local run: rank 0 of
    its own, starting devices - 1 more processes. A task of slurm/pretrain_common.sh's srun (which exports
    POSFREQ_SRUN_TASK=1) is SLURM's rank instead; a process without the variable keeps Lightning's choice."""
    task = {
        "SLURM_JOB_NAME": "bash",
        "SLURM_JOB_ID": "123456",
        "SLURM_NODELIST": "gpu-a",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
    }
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(SRUN_TASK, raising=False)
    cfg = config_from_dict(tiny(data_dir, tmp_path, devices=2))
    assert (build_fabric(cfg).global_rank, build_fabric(cfg).world_size) == (
        0,
        2,
    )  # Lightning's guess
    monkeypatch.setenv(SRUN_TASK, "1")
    fabric = build_fabric(cfg)
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size) == (1, 1, 2)
    assert fabric.strategy.cluster_environment.creates_processes_externally
    # a child run (the doctor's, the demo's) starts a rendezvous of its own: the marker stays behind
    assert SRUN_TASK not in local_launch_env(dict(os.environ))
    # an allocation of other task counts, which Lightning does not check in an salloc shell
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ConfigError, match="srun started 4 tasks, but the run asks for 2"):
        build_fabric(cfg)
