"""The optimizer side of a step: AdamW with its weight-decay groups, global gradient clipping, the LR schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from posfreq.train.run.config import TrainConfig


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
