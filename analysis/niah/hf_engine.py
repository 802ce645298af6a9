"""The probe's model through transformers (`--engine transformers`): any architecture transformers loads,
with RoPE or, on the model types they are checked on, any other position scheme (train/positions/hf_schemes.py)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from posfreq.analysis.niah.decoding import Generator
from posfreq.analysis.niah.settings import ProbeError, ProbeSettings
from posfreq.train.model.transformer import finite, row_groups


class TransformersGenerator(Generator):
    """The probe's Generator protocol over a transformers causal LM: greedy decoding on its KV cache and
    teacher-forced log-probabilities. Prompts of one batch have one length, so nothing is padded."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        stop: Callable[[int, list[int]], bool] | None = None,
        prefill_dtype: torch.dtype | None = None,
        prefill_tokens: int | None = None,
    ) -> list[list[int]]:
        """As train.model.transformer.Transformer.generate: a row ends when `stop` says so (that token kept); the last
        generated token is never fed back. Rows are decoded in groups of at most `prefill_tokens` prompt
        tokens (`train.model.transformer.row_groups`; None: all together), each group's prompts in one forward."""
        rows: list[list[int]] = []
        for group in row_groups(prompt_ids.shape[0], prompt_ids.shape[1], prefill_tokens):
            first = group.start
            rows += self._generate(
                prompt_ids[group],
                max_new_tokens,
                None
                if stop is None
                else lambda row, tokens, first=first: stop(first + row, tokens),
            )
        return rows

    def _generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        stop: Callable[[int, list[int]], bool] | None,
    ) -> list[list[int]]:
        from transformers import DynamicCache

        cache = {cache_keyword(self.model): DynamicCache(config=self.model.config)}
        step = self.model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1, **cache)
        rows: list[list[int]] = [[] for _ in range(prompt_ids.shape[0])]
        done = [False] * len(rows)
        for produced in range(1, max_new_tokens + 1):
            token = finite(step.logits[:, -1], f"decoding step {produced - 1}").argmax(-1)
            for row, tokens in enumerate(rows):
                if not done[row]:
                    tokens.append(int(token[row]))
                    done[row] = stop is not None and stop(row, tokens)
            if all(done) or produced == max_new_tokens:
                break
            step = self.model(input_ids=token[:, None], use_cache=True, **cache)
        return rows

    @torch.no_grad()
    def target_logprobs(
        self, input_ids: torch.Tensor, first_target: int, prefill_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(input_ids[:, j] | input_ids[:, :j]) for j >= first_target, and whether it is the argmax;
        rows in groups of at most `prefill_tokens` tokens, as `generate`. Logits are computed for the scored
        positions only (`logits_to_keep`), never for the whole (B, T, vocab) batch."""
        logprobs, hits = [], []
        kept = input_ids.shape[1] - first_target + 1
        for group in row_groups(input_ids.shape[0], input_ids.shape[1], prefill_tokens):
            logits = self.model(input_ids=input_ids[group], logits_to_keep=kept).logits
            logits = finite(logits[:, :-1].float(), "teacher forcing")
            targets = input_ids[group, first_target:]
            logprobs.append(logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0])
            hits.append(logits.argmax(-1) == targets)
        return torch.cat(logprobs), torch.cat(hits)

    @torch.no_grad()
    def continuation_logprobs(
        self,
        prompt_ids: torch.Tensor,
        continuations: Sequence[torch.Tensor],
        prefill_tokens: int | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As train.model.transformer.Transformer.continuation_logprobs: each (B, C) continuation teacher-forced on
        the prompts' KV cache alone, the prompts prefilled once per row group (the cache cut back after each)."""
        from transformers import DynamicCache

        length = prompt_ids.shape[1]
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in continuations]
        for group in row_groups(prompt_ids.shape[0], length, prefill_tokens):
            cache = DynamicCache(config=self.model.config)
            keyword = {cache_keyword(self.model): cache}
            first = self.model(
                input_ids=prompt_ids[group], use_cache=True, logits_to_keep=1, **keyword
            ).logits[:, -1:]
            for k, tokens in enumerate(continuations):
                tokens = tokens[group]
                logits = first
                if tokens.shape[1] > 1:
                    step = self.model(input_ids=tokens[:, :-1], use_cache=True, **keyword).logits
                    logits = torch.cat((first, step), dim=1)
                    crop_to(cache, length)
                logits = finite(logits.float(), "teacher forcing")
                parts[k].append(
                    (
                        logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0],
                        logits.argmax(-1) == tokens,
                    )
                )
        return [(torch.cat([p[0] for p in k]), torch.cat([p[1] for p in k])) for k in parts]


def crop_to(cache: Any, length: int) -> None:
    """Cut a transformers cache back to its first `length` positions: a negative crop removes that many positions
    from the end in every release (a positive one meant the size to keep before 5.x, and is refused since)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def cache_keyword(model) -> str:
    """The name a transformers model's forward takes its KV cache by: `cache` in newer releases (which warn on the
    old name), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def load_transformers_model(
    path: Path, settings: ProbeSettings, device: torch.device, train_len: int
) -> TransformersGenerator:
    """The model in float32, eval mode, with its position scheme and --position-options (defaults from
    `train_len`) through train/positions/hf_schemes.py."""
    from posfreq.train.positions.hf_schemes import load_causal_lm

    try:
        model = load_causal_lm(
            path, settings.positions, train_len, **dict(settings.position_options)
        )
    except ValueError as err:
        fix = (
            ""
            if "Fix:" in str(err)
            else ". Fix: change the position options, or use --engine posfreq"
        )
        raise ProbeError(
            f"--engine transformers --positions {settings.positions}: {err}{fix}"
        ) from err
    return TransformersGenerator(model.to(device))
