"""Where a run executes: the attention backend is checked before launch and named at start (train/run/parallel.py)."""

from __future__ import annotations

import pytest
from helpers.trainer import (
    run,
    tiny,
)

from posfreq.train.run.config import ConfigError, config_from_dict
from posfreq.train.run.parallel import attention_choice

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
