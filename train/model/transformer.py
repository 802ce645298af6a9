"""The Llama/TinyLlama decoder: embeddings, N x (RMSNorm, GQA + rotary, RMSNorm, SwiGLU), norm, head.

Inputs are packed: a flat (T,) token tensor with `cu_seqlens` marking the documents, so
attention is causal within each document and rotary positions restart at 0 in each. A (B, T)
batch without `cu_seqlens` is B documents of length T. Parameter names follow Hugging Face's
LlamaForCausalLM (without its "model." prefix), so weights map one to one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from posfreq.train.model.config import ModelConfig
from posfreq.train.model.fused import fused, rms_norm, swiglu
from posfreq.train.positions.merge import AttentionInputs
from posfreq.train.positions.rotary import RotaryBase
from posfreq.train.positions.scheme import PositionScheme
from posfreq.train.positions.schemes import build_scheme


def positions_in_sequences(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of every packed token within its own sequence: 0, 1, ... restarting at each start."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(
        cu_seqlens[:-1].long(), lengths, output_size=total
    )  # no host sync on CUDA
    return torch.arange(total, device=cu_seqlens.device) - starts


def uniform_cu_seqlens(batch: int, length: int, device: torch.device | str) -> Tensor:
    """cu_seqlens for `batch` sequences of equal `length`."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return fused(rms_norm)(x, self.weight, self.eps)


@dataclass
class LayerCache:
    """Rotated keys and values of one layer for B sequences of equal length, preallocated."""

    k: Tensor  # (B, capacity, Hkv, D), a view of head-major storage (see Transformer.new_caches)
    v: Tensor
    length: int = 0

    def append(self, k: Tensor, v: Tensor) -> None:
        """k, v: (B, t, Hkv, D) for the next t positions of every sequence."""
        t = k.shape[1]
        if self.length + t > self.k.shape[1]:
            raise RuntimeError(
                f"KV cache of capacity {self.k.shape[1]} cannot hold {self.length + t} positions"
            )
        self.k[:, self.length : self.length + t] = k
        self.v[:, self.length : self.length + t] = v
        self.length += t

    def filled(self) -> tuple[Tensor, Tensor]:
        """Views of the cached keys and values, (B, length, Hkv, D) each (strided: no copy)."""
        return self.k[:, : self.length], self.v[:, : self.length]

    def rows(self, rows: slice) -> "LayerCache":
        """The cache of sequences `rows` alone, sharing this cache's storage (its appends land here)."""
        return LayerCache(self.k[rows], self.v[rows], self.length)


def finite(logits: Tensor, where: str) -> Tensor:
    """`logits`, or FloatingPointError naming `where` and the rows when any is NaN or infinite: argmax and
    log-softmax would turn them into answers and scores that look like numbers."""
    bad = ~torch.isfinite(logits).reshape(logits.shape[0], -1).all(-1)
    if bad.any():
        raise FloatingPointError(
            f"non-finite logits at {where}, batch rows {bad.nonzero()[:, 0].tolist()}"
        )
    return logits


def row_groups(batch: int, length: int, max_tokens: int | None) -> list[slice]:
    """Consecutive row slices of a (batch, length) input holding at most `max_tokens` tokens each (one row at least).

    Long prompts are faster in such groups than all at once on a CPU, as smaller activations stay in
    cache (measured by benchmarks/probe.py, figures in docs/performance.md); None: one group.
    """
    rows = batch if max_tokens is None else max(1, max_tokens // length)
    return [slice(start, min(start + rows, batch)) for start in range(0, batch, rows)]


class Attention(nn.Module):
    """Grouped-query self-attention; how queries see key positions is the model's position scheme."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)

    def forward(self, x: Tensor, ctx: "ForwardContext", cache: LayerCache | None) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        k = ctx.scheme.rotate_keys(k, ctx.pos_q)
        cu_k, max_k, pos_k = ctx.cu_seqlens, ctx.max_seqlen, ctx.pos_q
        if cache is not None:
            batch = ctx.cu_seqlens.numel() - 1
            prefill = (
                cache.length == 0
            )  # the cache will hold exactly these keys: attend over them as computed
            cache.append(k.view(batch, -1, *k.shape[1:]), v.view(batch, -1, *v.shape[1:]))
            if not prefill:  # (and in their dtype: a bf16 prefill's cache is float32)
                k, v = cache.filled()
                (cu_k, pos_k), max_k = ctx.cached_layout(batch, cache.length), cache.length
        inputs = AttentionInputs(
            q, k, v, ctx.pos_q, pos_k, ctx.cu_seqlens, cu_k, ctx.max_seqlen, max_k, ctx.backend
        )
        return self.o_proj(ctx.scheme.attend(inputs).reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(fused(swiglu)(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, ctx: "ForwardContext", cache: LayerCache | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardContext:
    """Per-forward facts shared by all layers: sequence layout, positions, scheme, backend."""

    cu_seqlens: Tensor
    max_seqlen: int
    pos_q: Tensor
    scheme: PositionScheme
    backend: str
    _cached_layouts: dict[tuple[int, int], tuple[Tensor, Tensor]] = field(
        default_factory=dict, repr=False
    )

    def cached_layout(self, batch: int, length: int) -> tuple[Tensor, Tensor]:
        """cu_seqlens and positions of `batch` cached sequences of `length` keys, computed once per forward
        (every layer's cache holds as many)."""
        if (batch, length) not in self._cached_layouts:
            cu = uniform_cu_seqlens(batch, length, self.pos_q.device)
            self._cached_layouts[(batch, length)] = cu, positions_in_sequences(cu, batch * length)
        return self._cached_layouts[(batch, length)]


class Transformer(nn.Module):
    """TinyLlama-architecture causal LM over packed documents."""

    def __init__(self, config: ModelConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.set_positions("rope")
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    def set_positions(self, name: str, **options) -> None:
        """Select the position scheme used at attention time (rope, string, ...; see train.positions.schemes).

        The scheme is built on this model's own rotary base (a checkpoint's rope_scaling included)
        with the model's training length setting its defaults.
        """
        rope = RotaryBase(self.config.head_dim, self.config.rope_base, self.config.rope_scaling)
        self.positions = build_scheme(name, rope, self.config.train_len, **options)

    @torch.no_grad()
    def init_weights(self) -> None:
        """TinyLlama's init: N(0, sqrt(2 / 5d)) everywhere, output projections N(0, 1 / (sqrt(d) * n_layers))."""
        std = math.sqrt(2.0 / (5 * self.config.d_model))
        out_std = 1.0 / math.sqrt(self.config.d_model) / self.config.n_layers
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_output = name.endswith("o_proj") or name.endswith("down_proj")
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_output else std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _context(self, cu_seqlens: Tensor, max_seqlen: int, total: int) -> ForwardContext:
        """The per-forward facts of `total` packed tokens laid out by `cu_seqlens`."""
        pos = positions_in_sequences(cu_seqlens, total)
        return ForwardContext(cu_seqlens, max_seqlen, pos, self.positions, self.attention_backend)

    def hidden_states(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        caches: list[LayerCache] | None = None,
        position_offset: int = 0,
    ) -> Tensor:
        """Final-norm hidden states (T, d) of packed tokens."""
        ctx = self._context(cu_seqlens, max_seqlen, input_ids.shape[0])
        if position_offset:
            ctx.pos_q = ctx.pos_q + position_offset
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, caches[i] if caches is not None else None)
        return self.norm(x)

    def forward(
        self, input_ids: Tensor, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None
    ) -> Tensor:
        """Logits for packed (T,) tokens with `cu_seqlens`, or for a (B, T) batch of whole documents."""
        if input_ids.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError("pass cu_seqlens only with packed (T,) input_ids")
            b, t = input_ids.shape
            cu = uniform_cu_seqlens(b, t, input_ids.device)
            return self.lm_head(self.hidden_states(input_ids.reshape(-1), cu, t)).view(b, t, -1)
        if cu_seqlens is None:
            cu_seqlens = uniform_cu_seqlens(1, input_ids.shape[0], input_ids.device)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return self.lm_head(self.hidden_states(input_ids, cu_seqlens, max_seqlen))

    def new_caches(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> list[LayerCache]:
        """Empty KV caches, one per layer, for `batch` sequences of up to `capacity` positions.

        Stored head-major, (B, Hkv, capacity, D), and seen as (B, capacity, Hkv, D): the batched
        matmuls of decoding then read every (sequence, head) block in place, where a
        position-major cache made them copy the whole cache per layer and step (a third of a
        decoding step at batch 8 over 1K tokens on a CPU).
        """
        shape = (batch, self.config.n_kv_heads, capacity, self.config.head_dim)

        def empty() -> Tensor:
            return torch.empty(shape, dtype=dtype, device=device).transpose(1, 2)

        return [LayerCache(empty(), empty()) for _ in self.layers]

    def _prefill(
        self,
        prompt_ids: Tensor,
        room: int,
        prefill_dtype: torch.dtype | None,
        prefill_tokens: int | None,
    ) -> tuple[list[LayerCache], Tensor]:
        """KV caches holding a (B, T) batch of equal-length prompts with room for `room` more positions, and each
        prompt's last hidden state (B, d). The prompts' forward runs in row groups of at most `prefill_tokens`
        tokens (`row_groups`), under autocast to `prefill_dtype` when given; the caches keep the weights' dtype (or
        autocast's, when the caller runs under it)."""
        if prompt_ids.dim() != 2:
            raise ValueError(
                f"prompt_ids must be (batch, length), got shape {tuple(prompt_ids.shape)}"
            )
        batch, length = prompt_ids.shape
        device = prompt_ids.device
        dtype = self.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        caches = self.new_caches(batch, length + room, dtype, device)
        prefill = (
            contextlib.nullcontext()
            if prefill_dtype is None
            else torch.autocast(device.type, dtype=prefill_dtype)
        )
        last = torch.empty(batch, self.config.d_model, dtype=dtype, device=device)
        with prefill:
            for rows in row_groups(batch, length, prefill_tokens):
                n = rows.stop - rows.start
                cu = uniform_cu_seqlens(n, length, device)
                hidden = self.hidden_states(
                    prompt_ids[rows].reshape(-1), cu, length, [c.rows(rows) for c in caches]
                )
                last[rows] = hidden.view(n, length, -1)[:, -1]
        for cache in caches:
            cache.length = length
        return caches, last

    @torch.no_grad()
    def continuation_logprobs(
        self,
        prompt_ids: Tensor,
        continuations: Sequence[Tensor],
        prefill_tokens: int | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """Teacher forcing of several continuations of the same (B, T) prompts, the prompts prefilled once: for each
        (B, C) continuation, log p(c_j | prompt, c_<j) of its every token and whether it is the argmax, each scored
        on the prompt's KV cache alone (the cache is cut back to the prompt after each)."""
        length = prompt_ids.shape[1]
        room = max((c.shape[1] for c in continuations), default=0)
        caches, last = self._prefill(prompt_ids, room, None, prefill_tokens)
        batch, device = prompt_ids.shape[0], prompt_ids.device
        scored = []
        for tokens in continuations:
            logits = self.lm_head(last)[:, None]
            if tokens.shape[1] > 1:
                width = tokens.shape[1] - 1
                cu = uniform_cu_seqlens(batch, width, device)
                hidden = self.hidden_states(
                    tokens[:, :-1].reshape(-1), cu, width, caches, position_offset=length
                )
                logits = torch.cat((logits, self.lm_head(hidden.view(batch, width, -1))), dim=1)
            for cache in caches:
                cache.length = length
            logits = finite(logits.float(), "teacher forcing")
            scored.append(
                (
                    logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0],
                    logits.argmax(-1) == tokens,
                )
            )
        return scored

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        max_new_tokens: int,
        stop: Callable[[int, list[int]], bool] | None = None,
        prefill_dtype: torch.dtype | None = None,
        prefill_tokens: int | None = None,
    ) -> list[list[int]]:
        """Greedy decoding with a KV cache for a (B, T) batch of equal-length prompts.

        `stop(row, tokens_so_far)` ends a row when it returns True (that token is kept); decoding
        ends when every row has stopped. Returns each row's generated tokens, which sit at
        positions T .. T + max_new_tokens - 1 (the last one is never fed back). `prefill_dtype`
        (e.g. bfloat16) runs the prompt's forward under autocast to that dtype, while the KV
        cache and the decoding steps keep the weights' dtype: on a CPU with bf16 matrix units
        the prefill is about twice as fast, and single-token steps, which bf16 does not speed
        up there, stay exact.
        """
        caches, last = self._prefill(prompt_ids, max_new_tokens, prefill_dtype, prefill_tokens)
        batch, device = prompt_ids.shape[0], prompt_ids.device
        outputs: list[list[int]] = [[] for _ in range(batch)]
        done = [False] * batch
        one = uniform_cu_seqlens(batch, 1, device)
        for step in range(max_new_tokens):
            logits = finite(self.lm_head(last), f"decoding step {step}")
            next_ids = logits.argmax(-1)
            for row, token in enumerate(next_ids.tolist()):
                if not done[row]:
                    outputs[row].append(token)
                    done[row] = stop is not None and stop(row, outputs[row])
            if all(done) or step == max_new_tokens - 1:
                break
            last = self.hidden_states(next_ids, one, 1, caches, position_offset=caches[0].length)
        return outputs

    @torch.no_grad()
    def target_logprobs(
        self, input_ids: Tensor, first_target: int, prefill_tokens: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Teacher forcing: log p(input_ids[:, j] | input_ids[:, :j]) for j >= first_target, and whether it is the argmax.

        Logits are computed for those positions only, never for the whole (B, T, vocab) batch; one
        forward holds at most `prefill_tokens` tokens (`row_groups`).
        """
        if input_ids.dim() != 2 or not 1 <= first_target < input_ids.shape[1]:
            raise ValueError(
                f"need (batch, length) ids and 1 <= first_target < length, got {tuple(input_ids.shape)}, "
                f"{first_target}"
            )
        batch, length = input_ids.shape
        logprobs, correct = [], []
        for rows in row_groups(batch, length, prefill_tokens):
            n = rows.stop - rows.start
            cu = uniform_cu_seqlens(n, length, input_ids.device)
            hidden = self.hidden_states(input_ids[rows].reshape(-1), cu, length).view(n, length, -1)
            logits = finite(
                self.lm_head(hidden[:, first_target - 1 : length - 1]).float(), "teacher forcing"
            )
            targets = input_ids[rows, first_target:]
            logprobs.append(logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0])
            correct.append(logits.argmax(-1) == targets)
        return torch.cat(logprobs), torch.cat(correct)
