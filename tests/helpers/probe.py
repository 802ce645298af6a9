"""Helpers of the probe tests: fake models with known answers, a real tiny Transformer written as a
checkpoint, a byte-level chat tokenizer."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from posfreq.analysis.niah import runner as probe_runner
from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah import sources as probe_sources
from posfreq.analysis.tables.pass_curve import Analysis
from posfreq.scripts.commands.probe import derive_probed
from posfreq.train.checkpoint.layout import FORMAT, milestone_name
from posfreq.train.data.tokenizer import get_tokenizer
from posfreq.train.model.config import model_preset
from posfreq.train.model.transformer import Transformer

TOKENIZER = get_tokenizer("llama3")
NEEDLE_SENTENCE = re.compile(r"One of the magic numbers is (\d{6})\.")


class WindowModel:
    """Answers with the numbers of the needle sentences wholly inside the last `k` prompt tokens (k=None: all)."""

    def __init__(self, tokenizer, k: int | None = None, silent: bool = False) -> None:
        self.tokenizer, self.k, self.silent = tokenizer, k, silent
        self.calls: list[tuple[int, int]] = []

    def generate(
        self, prompt_ids, max_new_tokens, stop=None, prefill_dtype=None, prefill_tokens=None
    ):
        self.calls.append(tuple(prompt_ids.shape))
        rows = []
        for ids in prompt_ids.tolist():
            if self.silent:
                rows.append([self.tokenizer.eos_id])
                continue
            seen = ids if self.k is None else ids[-self.k :]
            numbers = NEEDLE_SENTENCE.findall(self.tokenizer.decode(seen))
            answer = "\n1. " + "\n2. ".join(numbers) + "\nExtra text 999999 after the list"
            rows.append(
                self.tokenizer.encode(answer)[:max_new_tokens] + [self.tokenizer.eos_id, 5, 6]
            )
        return rows


@dataclass
class FakeSource(probe_sources.ModelSource):
    """A model source whose model is a WindowModel (identified by its window k)."""

    model: object = None

    def load(self, settings, device, attention_backend="auto"):
        return self.model


def fake_source(model, name="fake", train_len=512, path=Path("fake")) -> FakeSource:
    fingerprint = f"window-{model.k}-{model.silent}"
    return FakeSource(
        name, path, "hf", fingerprint, "llama3", train_len, TOKENIZER.vocab_size, True, model=model
    )


def job(lengths, tests=6, batch=4, budget=32) -> probe_runner.Job:
    settings = probe_settings.ProbeSettings(
        tests_per_length=tests, haystack="noise", max_new_tokens=budget, teacher_forced=False
    )
    return probe_runner.Job(
        settings=settings,
        lengths=list(lengths),
        batch_size=batch,
        device=torch.device("cpu"),
        show_progress=False,
    )


def tiny_model(seed=0) -> Transformer:
    torch.manual_seed(seed)
    config = model_preset("tiny-2l-128", vocab_size=258, train_len=512, n_layers=1)
    model = Transformer(config, attention_backend="sdpa")
    with (
        torch.no_grad()
    ):  # larger weights: clear argmaxes, so float rounding cannot flip a greedy token
        model.lm_head.weight.mul_(30)
    return model.eval()


def write_checkpoint(
    run: Path, tokens: int, model: Transformer, hist: np.ndarray, spec="bytes"
) -> Path:
    """A trainer checkpoint in train.checkpoint.layout's layout (full state.pt, trainer.json written last)."""
    path = run / "checkpoints" / milestone_name(tokens)
    path.mkdir(parents=True)
    torch.save({"model": model.state_dict()}, path / "state.pt")
    np.save(path / "trained_lengths.npy", hist.astype(np.int64))
    (path / "model_config.json").write_text(json.dumps(model.config.to_dict()))
    tok = get_tokenizer(spec)
    (path / "tokenizer_spec.json").write_text(
        json.dumps(
            {"spec": spec, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
        )
    )
    (path / "trainer.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "step": tokens // 512,
                "run_tokens": tokens,
                "tokens_trained": tokens,
            }
        )
    )
    return path


def write_chat_tokenizer(
    directory: Path, template: bool = True, llama_bos: bool = False, no_bos: bool = False
) -> Path:
    """A byte-level tokenizer with ChatML special tokens (like small instruct models), or a Llama-style BOS;
    `no_bos`: as Qwen's tokenizers are saved, with no BOS at all (bos_token null, add_bos_token false)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<s>", "</s>"] if llama_bos else ["<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    if llama_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1]}
    if no_bos:
        config.update(bos_token=None, add_bos_token=False)
    if template:
        config["chat_template"] = (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}"
        )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def hf_source_for(directory: Path) -> probe_sources.ModelSource:
    tok = get_tokenizer(f"hf:{directory}")
    return probe_sources.ModelSource(
        "m", directory, "hf", "x", f"hf:{directory}", 1024, tok.vocab_size, tok.adds_bos
    )


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) and its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def make_fake_run(run: Path, train_len: int, ks: dict[int, int], seed: int = 0) -> dict[str, int]:
    """Checkpoints (tokens -> window k) with random trained-length histograms; returns name -> k."""
    rng = np.random.default_rng(seed)
    model = tiny_model()
    names = {}
    for tokens, k in ks.items():
        lengths = rng.integers(1, train_len + 1, size=tokens // train_len * 2)
        path = write_checkpoint(
            run, tokens, model, np.bincount(lengths, minlength=train_len + 1), spec="llama3"
        )
        config = json.loads(
            (path / "model_config.json").read_text()
        )  # the window model stands in for a
        (path / "model_config.json").write_text(
            json.dumps({**config, "vocab_size": TOKENIZER.vocab_size, "train_len": train_len})
        )  # llama3 one, trained at L
        names[path.name] = k
    return names


def probe_fake_run(
    run: Path,
    out: Path,
    names: dict[str, int],
    lengths,
    calls: list[str],
    monkeypatch,
    tests=4,
    figures=False,
    replace_stale=False,
    budget=32,
    **kw,
):
    def fake_load(self, settings, device, attention_backend="auto"):
        calls.append(self.name)
        return WindowModel(TOKENIZER, names[self.name])

    monkeypatch.setattr(probe_sources.ModelSource, "load", fake_load)
    j = job(lengths, tests, budget=budget)
    j.replace_stale = replace_stale
    out, probed = probe_runner.probe_run(run, out, j, **kw)
    sharded = kw.get("shard") is not None
    return derive_probed(out, probed if sharded else None, Analysis(), figures)
