"""The chunked loss equals plain logits + cross-entropy in value and gradients, and keeps no full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posfreq.train.data.packing import IGNORE_INDEX
from posfreq.train.model.config import model_preset
from posfreq.train.model.loss import default_chunk_tokens, head_returns_loss, linear_cross_entropy
from posfreq.train.model.transformer import Transformer

ROWS, LENGTH, D, VOCAB = 3, 37, 16, 53  # 111 tokens: chunks of 5, 7 and 64 leave a short last chunk


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The computation the lean loss replaces: full fp32 logits, then summed cross-entropy."""
    logits = hidden.float() @ weight.float().T
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def make_targets(seed: int = 0) -> torch.Tensor:
    """(ROWS * LENGTH,) targets with scattered ignored tokens and a middle row that has none at all."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    targets[torch.rand(ROWS, LENGTH, generator=g) < 0.2] = IGNORE_INDEX
    targets[1] = IGNORE_INDEX
    return targets.reshape(-1)


def leaves(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS * LENGTH, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, D, generator=g) / D**0.5).to(dtype).requires_grad_()
    return hidden, weight


def loss_and_grads(loss_fn, hidden, weight, targets, scale: float = 0.37):
    """Loss and d(scale * loss)/d(hidden, weight): a scale != 1 checks that backward applies grad_output."""
    loss = loss_fn(hidden, weight, targets)
    return (loss, *torch.autograd.grad(loss * scale, (hidden, weight)))


@pytest.mark.parametrize("chunk", [1, 5, 7, 64, ROWS * LENGTH, 1000, None])
def test_loss_and_grads_match_plain(chunk):
    hidden, weight = leaves()
    targets = make_targets()
    lean = loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=chunk), hidden, weight, targets
    )
    plain = loss_and_grads(plain_loss, hidden, weight, targets)
    for got, want in zip(lean, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lean[1][LENGTH : 2 * LENGTH].abs().max() == 0  # the row without targets gets no gradient


def test_no_targets_at_all_is_zero_loss_and_zero_grads():
    hidden, weight = leaves()
    targets = torch.full((ROWS * LENGTH,), IGNORE_INDEX)
    loss, grad_hidden, grad_weight = loss_and_grads(linear_cross_entropy, hidden, weight, targets)
    assert loss.item() == plain_loss(hidden, weight, targets).item() == 0.0
    assert not grad_hidden.any() and not grad_weight.any()


def test_tied_weight_gets_both_gradients():
    """The head's weight is also the input embedding: its gradient is the sum of both paths."""
    g = torch.Generator().manual_seed(1)
    embedding = (torch.randn(VOCAB, D, generator=g) / D**0.5).requires_grad_()
    mix = torch.randn(D, D, generator=g).requires_grad_()
    ids = torch.randint(0, VOCAB, (ROWS * LENGTH,), generator=g)
    targets = make_targets(seed=1)

    results = []
    for loss_fn in (lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=9), plain_loss):
        loss = loss_fn(torch.tanh(F.embedding(ids, embedding) @ mix), embedding, targets)
        results.append((loss, *torch.autograd.grad(loss, (embedding, mix))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_keep_fp32_logits_and_accumulation_with_bf16_matmuls():
    """Half inputs stay half in the matmuls (no float32 copy of a V x d weight, tensor cores on a GPU): the
    logits and the weight gradient accumulate in fp32, so the loss equals fp32 logits of the same bf16 values;
    the softmax gradient enters the gradient matmuls in bf16, so the gradients agree within its rounding."""
    hidden, weight = leaves(torch.bfloat16)
    targets = make_targets()
    lean = loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=10), hidden, weight, targets
    )
    plain = loss_and_grads(
        plain_loss, hidden, weight, targets
    )  # fp32 logits of the same bf16 values
    assert lean[0].dtype == torch.float32 and lean[1].dtype == lean[2].dtype == torch.bfloat16
    torch.testing.assert_close(lean[0], plain[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(lean[1:], plain[1:]):
        error = (got.float() - want.float()).abs().max()
        assert error <= 2**-7 * want.float().abs().max(), (error, want.abs().max())


def test_nothing_of_size_tokens_x_vocab_is_kept_for_backward():
    hidden, weight = leaves()
    targets = make_targets()
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        linear_cross_entropy(hidden, weight, targets, chunk_tokens=8)
    assert sorted(saved) == sorted([hidden.shape, weight.shape])  # grad_hidden and grad_weight only


def test_without_grad_mode_only_the_loss_is_computed():
    hidden, weight = leaves()
    targets = make_targets()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=8)
    assert not loss.requires_grad
    torch.testing.assert_close(
        loss, plain_loss(hidden, weight, targets).detach(), rtol=1e-5, atol=1e-5
    )


def test_liger_runs_only_where_it_trains():
    """liger's forward allocates the gradient buffers whatever the grad mode: validation (no_grad) must not use it."""
    from posfreq.train.model.loss import uses_liger

    assert uses_liger("cuda", grad_enabled=True)
    assert not uses_liger("cuda", grad_enabled=False)
    assert not uses_liger("cpu", grad_enabled=True)


def test_default_chunk_keeps_logits_under_the_cap():
    assert default_chunk_tokens(128_256) == 523  # 523 x 128,256 fp32 logits = 255.9 MiB
    assert default_chunk_tokens(128_256, cap_bytes=1) == 1
    assert default_chunk_tokens(258) * 258 * 4 <= 256 * 2**20


@pytest.mark.parametrize("tied", [False, True])
def test_head_returns_loss_makes_the_model_forward_the_loss(tied):
    """What the trainer does: the model's forward yields the loss, with every parameter's gradient as before."""
    torch.manual_seed(0)
    model = Transformer(
        model_preset("tiny-2l-128", vocab_size=97, tie_embeddings=tied), attention_backend="sdpa"
    )
    ids = torch.randint(0, 97, (64,))
    cu_seqlens = torch.tensor([0, 20, 64], dtype=torch.int32)
    targets = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
    targets[19] = IGNORE_INDEX

    with head_returns_loss(model.lm_head, targets, chunk_tokens=7):
        lean = model(ids, cu_seqlens, 44)
    lean_grads = torch.autograd.grad(lean, list(model.parameters()))
    logits = model(ids, cu_seqlens, 44)  # the head is a plain projection again
    assert logits.shape == (64, 97)
    plain = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(lean, plain, rtol=1e-5, atol=1e-5)
    for got, want in zip(lean_grads, torch.autograd.grad(plain, list(model.parameters()))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_matches_plain(dtype):
    """On CUDA the call runs liger-kernel's fused kernel when installed, else the chunked one."""
    hidden, weight = (x.detach().cuda().requires_grad_() for x in leaves(dtype))
    targets = make_targets().cuda()
    lean = loss_and_grads(linear_cross_entropy, hidden, weight, targets)
    plain = loss_and_grads(plain_loss, hidden, weight, targets)
    tolerance = (
        {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    )
    for got, want in zip(lean, plain):
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.fixture
def fresh_liger_state():
    from posfreq.train.model import loss

    loss.liger_state.cache_clear()
    yield loss
    loss.liger_state.cache_clear()


def test_a_missing_liger_is_one_warning_on_cuda_and_none_on_cpu(monkeypatch, fresh_liger_state):
    import sys

    loss = fresh_liger_state
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import raises ModuleNotFoundError
    assert loss._liger_loss() is None
    warning = loss.loss_kernel_warning("cuda")
    assert warning.startswith("warning: liger-kernel is not installed")
    assert "Fix: pip install 'liger-kernel>=0.8.1'" in warning and "chunked kernel" in warning
    assert "\n" not in warning
    assert loss.loss_kernel_warning("cpu") is None


def test_a_broken_liger_names_its_import_error(monkeypatch, tmp_path, fresh_liger_state):
    """A liger whose own imports fail (a triton that does not match torch) is not 'not installed'."""
    import sys

    package = tmp_path / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "transformers" / "__init__.py").write_text("")
    (package / "transformers" / "functional.py").write_text(
        "raise ImportError('cannot import name \\'Config\\' from triton')"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    loss = fresh_liger_state
    warning = loss.loss_kernel_warning("cuda")
    assert "failed to import (ImportError: cannot import name 'Config' from triton)" in warning
    assert loss._liger_loss() is None


def test_a_liger_older_than_the_addmm_release_is_used_but_named(monkeypatch, fresh_liger_state):
    import importlib.machinery
    import sys
    import types
    from importlib import metadata

    loss = fresh_liger_state
    fused = object()
    functional = types.SimpleNamespace(liger_fused_linear_cross_entropy=fused)
    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("t"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    real_version = metadata.version
    for version, named in (("0.8.0", True), ("0.8.1", False), ("0.10.2", False)):
        monkeypatch.setattr(
            metadata, "version", lambda n, v=version: v if n == "liger-kernel" else real_version(n)
        )
        loss.liger_state.cache_clear()
        assert loss._liger_loss() is fused
        warning = loss.loss_kernel_warning("cuda")
        assert (warning is not None) == named, (version, warning)
        if named:
            assert "liger-kernel 0.8.0" in warning and "chunked" not in warning
