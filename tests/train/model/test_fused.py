"""model.compile: the torch.compile'd RMSNorm, rotary rotation and SwiGLU against their eager definitions, and a
model's forward and gradients with them against the eager model's."""

from __future__ import annotations

import pytest
import torch

from posfreq.train.model import fused
from posfreq.train.model.config import model_preset
from posfreq.train.model.transformer import Transformer


def test_auto_compiles_on_cuda_only():
    assert fused.resolve_compile("auto", "cuda") and not fused.resolve_compile("auto", "cpu")
    assert fused.resolve_compile("on", "cpu") and not fused.resolve_compile("off", "cuda")


def reference_rms_norm(x, weight, eps):
    """Llama's RMSNorm written out in float64, cast as the model casts."""
    x64 = x.double()
    return weight * (x64 / (x64.pow(2).mean(-1, keepdim=True) + eps).sqrt()).to(x.dtype)


@pytest.mark.slow
def test_compiled_model_equals_the_eager_model(monkeypatch):
    """Forward and every gradient of a small model with the fused kernels equal the eager model's; the eager
    kernels themselves equal their written-out definitions."""
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    weight = torch.rand(16) + 0.5
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-5).double(), reference_rms_norm(x, weight, 1e-5).double()
    )
    gate, up = torch.randn(2, 7, 9).unbind(0)
    torch.testing.assert_close(fused.swiglu(gate, up), gate / (1 + torch.exp(-gate)) * up)
    model = Transformer(
        model_preset("tiny-2l-128", vocab_size=97, n_layers=2), attention_backend="sdpa"
    )
    ids = torch.randint(0, 97, (64,))
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, cu, 44).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    calls = []
    real = fused._compiled
    monkeypatch.setattr(fused, "_compiled", lambda f: calls.append(f.__name__) or real(f))
    eager = loss_and_grads()
    assert not calls
    fused.use_fused(True)
    try:
        compiled = loss_and_grads()
    finally:
        fused.use_fused(False)
    assert {"rms_norm", "rotate", "swiglu"} <= set(calls)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
