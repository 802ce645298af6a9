"""The NIAH probe end to end: fake models with known answers, a real tiny Transformer, run-level
tables against a naive Eq. 2, resumability, and the notebook executed on fixture runs."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from posfreq.analysis import probe, results
from posfreq.analysis.effective_length import RUN_COLUMNS, Analysis, read_csv
from posfreq.analysis.niah import (
    ANSWER_PREFIX,
    INSTRUCTION,
    QUESTION,
    NiahBuilder,
    PromptFormat,
    answer_text,
)
from posfreq.train.checkpoint import FORMAT, milestone_name
from posfreq.train.cli import parse
from posfreq.train.config import model_preset
from posfreq.train.model import Transformer
from posfreq.train.positions import SCHEMES
from posfreq.train.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]
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
class FakeSource(probe.ModelSource):
    """A model source whose model is a WindowModel (identified by its window k)."""

    model: object = None

    def load(self, settings, device, attention_backend="auto"):
        return self.model


def fake_source(model, name="fake", train_len=512, path=Path("fake")) -> FakeSource:
    fingerprint = f"window-{model.k}-{model.silent}"
    return FakeSource(
        name, path, "hf", fingerprint, "llama3", train_len, TOKENIZER.vocab_size, True, model=model
    )


def job(lengths, tests=6, batch=4, threshold=0.5, budget=32) -> probe.Job:
    settings = probe.ProbeSettings(
        tests_per_length=tests, haystack="noise", max_new_tokens=budget, teacher_forced=False
    )
    return probe.Job(
        settings,
        list(lengths),
        batch,
        torch.device("cpu"),
        Analysis(threshold=threshold),
        figures=False,
        show_progress=False,
    )


def run_one(tmp_path, model, lengths, tests=6, **kw) -> tuple[dict, list[dict]]:
    j = job(lengths, tests, **kw)
    row = probe.probe_models([fake_source(model)], [tmp_path], j, probe.Builders("noise"))[0]
    return row, results.read_records(tmp_path, lengths)


def test_oracle_passes_everything_and_silence_fails_everything(tmp_path):
    row, records = run_one(tmp_path / "oracle", WindowModel(TOKENIZER), [160, 256, 384])
    assert all(all(r["hits_anywhere"]) for r in records) and len(records) == 18
    assert all(
        sum(r["hits_first_line"]) == 1 for r in records
    )  # the old rule: a list scores one needle
    assert row["effective_length"] == 384 and row["effective_length_status"] == "all_passed"
    assert row["effective_length_lo"] == row["effective_length_hi"] == 384
    row, records = run_one(tmp_path / "silent", WindowModel(TOKENIZER, silent=True), [160, 256])
    assert not any(any(r["hits_anywhere"]) for r in records)
    assert row["effective_length"] == 0 and row["effective_length_status"] == "none_passed"
    assert row["f_effective_length"] == ""
    with open(tmp_path / "silent" / "summary.csv") as fh:
        assert [float(r["pass_rate"]) for r in csv.DictReader(fh)] == [0.0, 0.0]


def test_window_model_fails_exactly_for_needles_beyond_k(tmp_path):
    k, lengths, budget = 120, [160, 256, 384, 512, 640], 32
    row, records = run_one(tmp_path, WindowModel(TOKENIZER, k), lengths, tests=10, budget=budget)
    builder = NiahBuilder(TOKENIZER, "noise", PromptFormat(answer_budget=budget))
    expected_rates = []
    for length in lengths:
        tests = builder.make_tests(length, 10, 0)
        mine = [r for r in records if r["length"] == length]
        for test, rec in zip(tests, mine):
            visible = [
                length - budget - p <= k for p in test.positions
            ]  # needle starts within the last k tokens
            assert rec["hits_anywhere"] == visible, (length, test.positions)
        expected_rates.append(
            np.mean([sum(length - budget - p <= k for p in t.positions) >= 2 for t in tests])
        )
    first_fail = next(i for i, r in enumerate(expected_rates) if r < 0.5)
    assert expected_rates[0] == 1.0 and 0 < first_fail
    assert (
        row["effective_length"] == lengths[first_fail - 1]
        and row["effective_length_status"] == "ok"
    )
    for length, rate in zip(lengths, expected_rates):
        assert row[f"pass_rate_{length}"] == pytest.approx(rate)
    # Distance-resolved: a needle is recalled exactly when its distance to the question keeps it in the window.
    with open(tmp_path / "distance.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["distance_hi"]) for r in table] == lengths
    tail = len(builder._tail)
    for r in table:
        lo, hi = int(r["distance_lo"]), int(r["distance_hi"])
        if r["needle_recall"] == "":
            continue
        if hi + tail <= k:
            assert float(r["needle_recall"]) == 1.0
        if lo + tail > k:
            assert float(r["needle_recall"]) == 0.0


def test_lengths_and_options_parsing():
    assert probe.parse_lengths("128:512:128") == [128, 256, 384, 512]
    assert probe.parse_lengths("512,128") == [128, 512]
    with pytest.raises(argparse.ArgumentTypeError):
        probe.parse_lengths("128:512:0")
    args = parse(
        probe.build_parser(),
        [
            "--run",
            "r",
            "--position-options.shift",
            "1365",
            "--position-options.mode",
            "fast",
            "--teacher-forced",
            "false",
        ],
    )
    assert args.position_options == {"shift": 1365, "mode": "fast"} and args.teacher_forced is False


def test_the_attention_backend_is_checked_for_the_probe_it_runs(monkeypatch):
    """On a GPU the probe runs in bf16; a two-pass scheme needs a kernel that returns the log-sum-exp."""
    import posfreq.train.attention as attention

    monkeypatch.setattr(attention, "kernel_present", lambda name: True)
    gpu = torch.device("cuda")
    job = probe.Job(probe.ProbeSettings(positions="string"), None, 1, gpu)
    assert job.attention.startswith("auto -> varlen (cuda, bfloat16, log-sum-exp")
    with pytest.raises(
        ValueError, match="--attention-backend: attention backend 'xformers' .*log-sum-exp"
    ):
        probe.Job(
            probe.ProbeSettings(positions="string"), None, 1, gpu, attention_backend="xformers"
        )
    assert probe.Job(
        probe.ProbeSettings(), None, 1, gpu, attention_backend="xformers"
    ).attention.startswith("xformers")
    fp32 = probe.Job(probe.ProbeSettings(precision="float32"), None, 1, gpu)
    assert fp32.attention.startswith("auto -> sdpa")  # FlashAttention kernels refuse float32
    with pytest.raises(ValueError, match="'flash' .*float32"):
        probe.Job(probe.ProbeSettings(precision="float32"), None, 1, gpu, attention_backend="flash")


def test_settings_are_checked_and_precision_resolved():
    """Checks live in the dataclasses (so a library caller gets them too); the CLI turns them into usage errors."""
    with pytest.raises(ValueError, match="bos"):
        probe.ProbeSettings(bos="sometimes")
    with pytest.raises(ValueError, match="tests_per_length"):
        probe.ProbeSettings(tests_per_length=0)
    job = probe.Job(probe.ProbeSettings(), None, 1, torch.device("cpu"))
    assert job.settings.precision == "float32"  # auto on CPU, resolved before any key is computed
    with pytest.raises(ValueError, match="bfloat16-prefill is for CPUs"):
        probe.Job(probe.ProbeSettings(precision="bfloat16-prefill"), None, 1, torch.device("cuda"))
    capped = probe.Job(probe.ProbeSettings(), None, 8, torch.device("cpu"), batch_tokens=8192)
    assert [capped.batch_for(n) for n in (512, 1024, 4096, 8192, 32768)] == [8, 8, 2, 1, 1]
    assert (
        job.batch_for(32768) == 1
        and probe.Job(probe.ProbeSettings(), None, 8, torch.device("cpu")).batch_for(32768) == 8
    )  # no token cap: the batch size at every length
    with pytest.raises(ValueError, match="prefill_tokens"):
        probe.Job(probe.ProbeSettings(), None, 8, torch.device("cpu"), prefill_tokens=0)
    for bad in (
        ["--tests-per-length", "0"],
        ["--batch-size", "0"],
        ["--batch-tokens", "0"],
        ["--prefill-tokens", "0"],
        ["--lengths", "1:2:0"],
        ["--shard", "3/2"],
        ["--positions", "nope"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            probe.main(["--checkpoint" if bad[0] != "--shard" else "--run", "x", *bad])
        assert exit_info.value.code == 2, bad


# ------------------------------------------------------------------ real tiny Transformer


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
    """A trainer checkpoint in train.checkpoint's layout (full state.pt, trainer.json written last)."""
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
        json.dumps({"format": FORMAT, "step": tokens // 512, "tokens_seen": tokens})
    )
    return path


def test_batched_and_unbatched_decoding_agree_on_a_real_model(tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "run", 1024, tiny_model(), np.bincount([512, 300], minlength=513)
    )
    settings = probe.ProbeSettings(tests_per_length=5, haystack="noise", max_new_tokens=40)
    source = probe.checkpoint_source(ckpt, settings)
    assert (
        source.train_len == 512 and source.tokenizer_spec == "bytes" and source.tokens_seen == 1024
    )
    model = source.load(settings, torch.device("cpu"))
    builder = probe.Builders("noise").for_source(source, settings)
    tests = builder.make_tests(416, 5, 0)
    assert (
        tests[0].input_ids[0] != builder.tokenizer.bos_id
    )  # our checkpoints train without BOS: auto adds none
    cpu = torch.device("cpu")
    one = [
        probe.generate_answers(model, builder.tokenizer, [t], cpu, max_new_tokens=40)[0]
        for t in tests
    ]
    many = probe.generate_answers(model, builder.tokenizer, tests, cpu, max_new_tokens=40)
    assert one == many and len(set(one)) > 1
    # The CLI on the same checkpoint writes every output file and records the answers decoded above.
    out = tmp_path / "out"
    probe.main(
        [
            "--checkpoint",
            str(ckpt),
            "--lengths",
            "416",
            "--tests-per-length",
            "5",
            "--haystack",
            "noise",
            "--batch-size",
            "3",
            "--max-new-tokens",
            "40",
            "--out",
            str(out),
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    records = results.read_records(out, [416])
    assert [r["generated"] for r in records] == one
    assert all(len(r["tf_logprob"]) == 4 and all(lp < 0 for lp in r["tf_logprob"]) for r in records)
    for name in (
        "probe.json",
        "key.json",
        "summary.csv",
        "distance.csv",
        "effective_length.csv",
        "failure_by_thirds.csv",
        "failure_by_thirds.md",
        "trained_lengths.npy",
        "figures/niah_heatmap.png",
        "figures/niah_heatmap.pdf",
        "figures/failure_by_thirds.png",
    ):
        assert (out / name).is_file(), name
    meta = json.loads((out / "probe.json").read_text())
    assert meta["haystack_sha256"] == builder.haystack.sha256
    assert (
        meta["tokens_seen"] == 1024
        and meta["code_version"]
        and meta["prompt_format"]["bos"] is False
    )


def test_no_token_is_generated_or_fed_at_a_position_beyond_the_test_length(tmp_path, monkeypatch):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    fed: list[tuple[int, int]] = []  # (first, last) position of every forward call
    original = Transformer.hidden_states

    def spy(self, input_ids, cu_seqlens, max_seqlen, caches=None, position_offset=0):
        fed.append((position_offset, position_offset + max_seqlen - 1))
        return original(self, input_ids, cu_seqlens, max_seqlen, caches, position_offset)

    monkeypatch.setattr(Transformer, "hidden_states", spy)
    out = tmp_path / "out"
    probe.main(
        [
            "--checkpoint",
            str(ckpt),
            "--lengths",
            "420,512",
            "--tests-per-length",
            "3",
            "--haystack",
            "noise",
            "--max-new-tokens",
            "40",
            "--out",
            str(out),
            "--quiet",
            "--no-figures",
        ]
    )
    records = results.read_records(out, [420, 512])
    assert {r["prompt_length"] for r in records} == {420 - 40, 512 - 40}
    assert max(last for _, last in fed) <= 512 - 1
    decode_steps = [first for first, last in fed if first == last]  # one generated token fed back
    # The whole budget was used (this model never stops early): tokens fed at positions up to length - 2, the last
    # generated token sits at length - 1 and is never fed; nothing reaches a position >= the test length.
    assert {420 - 2, 512 - 2} <= set(decode_steps) and max(decode_steps) == 512 - 2


def test_teacher_forced_score_equals_a_naive_per_token_computation():
    model = tiny_model(seed=3)
    tok = get_tokenizer("bytes")
    builder = NiahBuilder(tok, "noise", PromptFormat(answer_budget=40, bos=False))
    tests = builder.make_tests(420, 2, seed=5)
    for order in probe.ANSWER_ORDERS:
        scores = probe.teacher_forced(model, tok, tests, torch.device("cpu"), order=order)
        for test, score in zip(tests, scores):
            ids, spans = probe.reference_answer(tok, test, order)
            assert tok.decode(ids) == answer_text(
                sorted(
                    test.needles,
                    key=lambda n: (
                        test.needles.index(n) if order == "document" else -test.needles.index(n)
                    ),
                )
            )
            for j, (a, b) in enumerate(spans):
                assert tok.decode(ids[a:b]) == test.needles[j]
                logprob, correct = 0.0, []
                for t in range(
                    a, b
                ):  # naive: one full forward per answer token, no cache, no batching
                    prefix = torch.tensor([test.input_ids.tolist() + ids[:t]])
                    with torch.no_grad():
                        logits = model(prefix)[0, -1]
                    logprob += float(logits.log_softmax(-1)[ids[t]])
                    correct.append(int(logits.argmax()) == ids[t])
                assert score["tf_logprob"][j] == pytest.approx(logprob, rel=1e-4, abs=1e-3)
                assert score["tf_token_accuracy"][j] == pytest.approx(np.mean(correct))


def test_every_position_scheme_runs_through_the_probe(tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "run", 1024, tiny_model(), np.bincount([512, 300], minlength=513)
    )
    settings = probe.ProbeSettings(haystack="noise")
    model = probe.checkpoint_source(ckpt, settings).load(settings, torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 400))
    with torch.no_grad():
        rope = model(ids)
        for scheme in SCHEMES[1:]:  # every scheme changes what a 400-token input sees at L = 512
            model.set_positions(scheme)
            assert not torch.allclose(model(ids), rope, atol=1e-4), scheme
    for scheme in SCHEMES:
        out = tmp_path / scheme
        probe.main(
            [
                "--checkpoint",
                str(ckpt),
                "--positions",
                scheme,
                "--lengths",
                "420",
                "--tests-per-length",
                "2",
                "--haystack",
                "noise",
                "--max-new-tokens",
                "40",
                "--out",
                str(out),
                "--quiet",
                "--no-figures",
            ]
        )
        assert json.loads((out / "probe.json").read_text())["settings"]["positions"] == scheme
        assert len(results.read_records(out, [420])) == 2


# ------------------------------------------------------------------ results keyed by content


def test_same_folder_names_never_share_results(tmp_path, monkeypatch):
    hist = np.bincount([512], minlength=513)
    a = write_checkpoint(tmp_path / "A", 1024, tiny_model(seed=1), hist)
    b = write_checkpoint(tmp_path / "B", 1024, tiny_model(seed=2), hist)
    assert a.name == b.name
    monkeypatch.chdir(tmp_path)
    decoded: list[str] = []
    original = probe.probe_length
    monkeypatch.setattr(
        probe,
        "probe_length",
        lambda m, plan, *x: decoded.append(str(plan.source.path)) or original(m, plan, *x),
    )
    common = [
        "--lengths",
        "420",
        "--tests-per-length",
        "2",
        "--haystack",
        "noise",
        "--max-new-tokens",
        "40",
        "--quiet",
        "--no-figures",
    ]
    probe.main(["--checkpoint", str(a), *common])
    probe.main(["--checkpoint", str(b), *common])
    assert decoded == [str(a), str(b)]  # B decoded afresh, nothing of A's reused
    outs = sorted((tmp_path / "runs" / "probe").iterdir())
    assert len(outs) == 2 and all(o.name.startswith(a.name + "-") for o in outs)
    answers = [[r["generated"] for r in results.read_records(o, [420])] for o in outs]
    assert answers[0] != answers[1]
    probe.main(["--checkpoint", str(a), *common])  # the same model again: reused, not decoded
    assert decoded == [str(a), str(b)]
    # One explicit --out for both: the second is refused, and replaced only when asked.
    shared = tmp_path / "shared"
    probe.main(["--checkpoint", str(a), "--out", str(shared), *common])
    with pytest.raises(SystemExit, match="another key .*model"):
        probe.main(["--checkpoint", str(b), "--out", str(shared), *common])
    probe.main(["--checkpoint", str(b), "--out", str(shared), "--replace-stale", *common])
    assert [r["generated"] for r in results.read_records(shared, [420])] == answers[
        [o.name for o in outs].index(
            next(
                o.name
                for o in outs
                if json.loads((o / "probe.json").read_text())["model_path"] == str(b)
            )
        )
    ]


def test_every_setting_and_the_weights_change_the_key(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    base = probe.ProbeSettings(haystack="noise")
    variants = [
        base,
        *(
            replace(base, **{k: v})
            for k, v in (
                ("tests_per_length", 7),
                ("seed", 1),
                ("max_new_tokens", 64),
                ("positions", "string"),
                ("position_options", {"shift": 100}),
                ("precision", "bfloat16"),
                ("teacher_forced", False),
                ("answer_order", "nearest_first"),
                ("bos", "always"),
                ("haystack", "pg"),
                ("tokenizer", f"hf:{write_chat_tokenizer(tmp_path / 'tok', template=False)}"),
            )
        ),
    ]
    keys = set()
    for settings in variants:
        source = probe.checkpoint_source(ckpt, settings)
        keys.add(
            probe.result_key(
                probe.key_parts(
                    source, probe.Builders(settings.haystack).for_source(source, settings), settings
                )
            )
        )
    assert len(keys) == len(variants)
    source = probe.checkpoint_source(ckpt, base)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["model"]["norm.weight"][0] += 1e-3
    torch.save(state, ckpt / "state.pt")
    assert probe.checkpoint_source(ckpt, base).fingerprint != source.fingerprint


# ------------------------------------------------------------------ prompts: BOS and chat templates


def write_chat_tokenizer(directory: Path, template: bool = True, llama_bos: bool = False) -> Path:
    """A byte-level tokenizer with ChatML special tokens (like small instruct models), or a Llama-style BOS."""
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
    if template:
        config["chat_template"] = (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}"
        )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def hf_source_for(directory: Path) -> probe.ModelSource:
    tok = get_tokenizer(f"hf:{directory}")
    return probe.ModelSource(
        "m", directory, "hf", "x", f"hf:{directory}", 1024, tok.vocab_size, tok.adds_bos
    )


def test_bos_and_chat_template_give_the_documented_tokens(tmp_path):
    chatml = write_chat_tokenizer(tmp_path / "chatml")
    tok = get_tokenizer(f"hf:{chatml}")
    start, end = (
        tok.bos_id,
        tok.eos_id,
    )  # <|im_start|> is this tokenizer's "BOS": it must never be used as one
    builders = probe.Builders("noise")
    source = hf_source_for(chatml)

    def ids(**settings) -> list[int]:
        s = probe.ProbeSettings(haystack="noise", max_new_tokens=16, **settings)
        return builders.for_source(source, s).build(700, 0, 0).input_ids.tolist()

    plain = ids()
    assert start not in plain and tok.decode(plain).startswith(INSTRUCTION)
    assert tok.decode(plain).endswith(QUESTION + "\n" + ANSWER_PREFIX)
    assert ids(bos="always")[0] == start and ids(bos="always")[1:50] == plain[:49]
    chat = ids(chat_template=True)
    text = tok.decode(chat)
    assert (
        chat[0] == start and chat.count(start) == 2 and chat.count(end) == 1
    )  # special ids, not text
    assert text.startswith("<|im_start|>user\n" + INSTRUCTION)
    assert text.endswith(QUESTION + "<|im_end|>\n<|im_start|>assistant\n" + ANSWER_PREFIX)
    assert (
        ids(chat_template=True, bos="auto") == chat
    )  # auto never adds a BOS of its own to a template
    with pytest.raises(SystemExit, match="no chat template"):
        builders.for_source(
            hf_source_for(write_chat_tokenizer(tmp_path / "plain", template=False)),
            probe.ProbeSettings(haystack="noise", chat_template=True),
        )
    llama = write_chat_tokenizer(tmp_path / "llama", template=False, llama_bos=True)
    assert get_tokenizer(f"hf:{llama}").adds_bos and not tok.adds_bos
    llama_ids = builders.for_source(
        hf_source_for(llama), probe.ProbeSettings(haystack="noise", max_new_tokens=16)
    )
    assert llama_ids.build(700, 0, 0).input_ids[0] == 0  # the post-processor's BOS


def test_a_hostile_chat_template_cannot_reach_python(tmp_path):
    directory = write_chat_tokenizer(tmp_path / "evil")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        get_tokenizer(f"hf:{directory}").chat_frame()


@pytest.mark.parametrize(
    "template,message",
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "within 5 s",
        ),
        (
            "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
            "more than 1,000,000 characters",
        ),
        ("{{ range(10**5) | list | length }}{{ range(10**9) | list }}", "OverflowError"),
        ("{% set x = [0] * 10**7 %}{{ x | length }}", "repetition of 10,000,000 items"),
        ("{{ 'a' * 10**8 }}", "repetition of 100,000,000 items"),
        ("{{ 2 ** 100000000 }}", "power beyond 64"),
    ],
)
def test_a_chat_template_that_loops_or_overflows_is_one_error(tmp_path, template, message):
    import time

    directory = write_chat_tokenizer(tmp_path / "t")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        get_tokenizer(f"hf:{directory}").chat_frame()
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ run level


def naive_f(hist: np.ndarray, i: int) -> int:
    """Eq. 2 by a loop over every trained segment: sum of max(n - i, 0)."""
    return sum(int(count) * max(n - i, 0) for n, count in enumerate(hist))


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
    **kw,
):
    def fake_load(self, settings, device, attention_backend="auto"):
        calls.append(self.name)
        return WindowModel(TOKENIZER, names[self.name])

    monkeypatch.setattr(probe.ModelSource, "load", fake_load)
    j = job(lengths, tests)
    j.figures, j.replace_stale = figures, replace_stale
    return probe.probe_run(run, out, j, **kw)[1]


def test_run_table_f_matches_naive_eq2_and_resumes(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60, 81_920: 110, 163_840: 10_000})
    lengths = [160, 256, 384, 512]
    calls: list[str] = []
    rows = probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == sorted(names)
    with open(out / "effective_length.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["tokens_seen"]) for r in table] == [40_960, 81_920, 163_840]
    assert list(table[0])[: len(RUN_COLUMNS)] == list(RUN_COLUMNS)
    assert [c for c in table[0] if c.startswith("pass_rate_")] == [
        f"pass_rate_{n}" for n in lengths
    ]
    for r in table:
        hist = np.load(run / "checkpoints" / r["checkpoint"] / "trained_lengths.npy")
        eff = int(r["effective_length"])
        if r["effective_length_status"] == "none_passed":
            assert r["f_effective_length"] == ""
        else:
            assert int(r["f_effective_length"]) == naive_f(hist, eff)
        if r["effective_length_lo"] not in ("", "0"):
            assert int(r["f_effective_length_lo"]) == naive_f(hist, int(r["effective_length_lo"]))
        assert int(r["effective_length_lo"]) <= eff <= int(r["effective_length_hi"])
        assert int(r["train_len"]) == 512 and r["positions"] == "rope"
    assert (
        int(table[-1]["effective_length"]) == 512
        and table[-1]["effective_length_status"] == "all_passed"
    )
    effective = [int(r["effective_length"]) for r in table]
    assert (
        0 < effective[0] <= effective[1] < effective[2]
        and table[1]["effective_length_status"] == "ok"
    )
    last_hist = np.load(run / "checkpoints" / table[-1]["checkpoint"] / "trained_lengths.npy")
    with open(out / "position_frequency.csv") as fh:
        assert [int(r["f"]) for r in csv.DictReader(fh)][:3] == [
            naive_f(last_hist, i) for i in range(3)
        ]
    with open(out / "distance_by_checkpoint.csv") as fh:
        distance = list(csv.DictReader(fh))
    assert len(distance) == 3 * len(lengths)
    for d in distance:
        hist = np.load(run / "checkpoints" / d["checkpoint"] / "trained_lengths.npy")
        assert int(d["f_distance_lo"]) == naive_f(hist, int(d["distance_lo"]))
    assert rows == results.derive_run(out, Analysis(), figures=False)

    # Second run: nothing is loaded or decoded again, the per-test files are untouched.
    jsonl = out / sorted(names)[0] / "tests" / "L000160.jsonl"
    stamp = jsonl.stat().st_mtime_ns
    calls.clear()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == [] and jsonl.stat().st_mtime_ns == stamp
    # A lost length is redone for its checkpoint only.
    (out / sorted(names)[1] / "tests" / "L000384.json").unlink()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == [sorted(names)[1]]
    # New settings (more tests) are another key: refused in the same directory, redone everywhere when asked.
    calls.clear()
    with pytest.raises(SystemExit, match="another key"):
        probe_fake_run(run, out, names, lengths, calls, monkeypatch, tests=5)
    probe_fake_run(run, out, names, lengths, calls, monkeypatch, tests=5, replace_stale=True)
    assert calls == sorted(names)


def test_threshold_is_recomputed_from_stored_records(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 150, 81_920: 300})
    probe_fake_run(run, out, names, [160, 256, 384, 512], [], monkeypatch, tests=8)
    before = {r["checkpoint"]: r for r in read_csv(out / "effective_length.csv")}
    from posfreq.analysis import effective_length

    monkeypatch.setattr(
        probe.ModelSource,
        "load",
        lambda *a, **k: pytest.fail("re-derivation must not load a model"),
    )
    effective_length.main(
        [str(out), "--threshold", "0.99", "--min-retrieved", "1", "--out", str(tmp_path / "fig")]
    )
    after = {r["checkpoint"]: r for r in read_csv(out / "effective_length.csv")}
    for name, row in after.items():
        assert row["threshold"] == 0.99 and row["min_retrieved"] == 1
        rates = [row[f"pass_rate_{n}"] for n in (160, 256, 384, 512)]
        assert rates == sorted(rates, reverse=True) and rates >= [
            before[name][f"pass_rate_{n}"] for n in (160, 256, 384, 512)
        ]
        expected = effective_length.effective_length([160, 256, 384, 512], rates, 0.99).value
        assert row["effective_length"] == expected


def test_shards_then_merge(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "probe"
    names = make_fake_run(run, 512, {40_960: 150, 81_920: 300, 122_880: 400})
    calls: list[str] = []
    assert (
        len(probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, shard=(1, 2)))
        == 1
    )
    assert calls == [sorted(names)[1]]
    probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, shard=(0, 2))
    assert not (out / "effective_length.csv").exists()
    calls.clear()
    rows = probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, merge_only=True)
    assert calls == [] and len(rows) == 3 and (out / "effective_length.csv").is_file()
    # A checkpoint retrained in place (new weights, same folder): its old results are left out of the merge.
    retrained = run / "checkpoints" / sorted(names)[0] / "state.pt"
    state = torch.load(retrained, weights_only=True)
    state["model"]["norm.weight"][0] += 1.0
    torch.save(state, retrained)
    rows = probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, merge_only=True)
    assert [r["checkpoint"] for r in rows] == sorted(names)[1:]
    assert json.loads((out / "probe.json").read_text())["missing"] == [sorted(names)[0]]


# ------------------------------------------------------------------ notebook


def write_fixture_runs(root: Path, monkeypatch) -> list[Path]:
    """Two fake runs (L = 256 and 512) probed by the real pipeline with window models; returns their dirs."""
    runs = []
    for train_len, ks in (
        (256, {20_480: 40, 40_960: 70, 81_920: 1000}),
        (512, {20_480: 60, 40_960: 130, 81_920: 1000}),
    ):
        run = root / f"L{train_len}"
        names = make_fake_run(run, train_len, ks, seed=train_len)
        probe_fake_run(
            run,
            run / "probe",
            names,
            [160, *range(256, train_len + 1, 128)],
            [],
            monkeypatch,
            tests=4,
            figures=train_len == 256,
        )
        runs.append(run)
    return runs


def test_notebook_runs_on_fixture_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    runs = write_fixture_runs(tmp_path / "runs", monkeypatch)
    assert (runs[0] / "probe" / "figures" / "fig2a_effective_length_vs_tokens.png").is_file()
    monkeypatch.setenv("POSFREQ_RUNS", os.pathsep.join(str(r) for r in runs))
    monkeypatch.setenv("POSFREQ_FIGURES", str(tmp_path / "figures"))
    notebook = nbformat.read(
        REPO / "notebooks" / "effective_length_vs_position_frequency.ipynb", as_version=4
    )
    nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO / "notebooks")}},
    ).execute()
    for stem in (
        "fig2a_effective_length_vs_tokens",
        "fig2b_frequency_vs_effective_length",
        "fig3_position_frequency",
    ):
        assert (tmp_path / "figures" / f"{stem}.png").is_file(), stem
    text = "".join(
        o.get("text", "")
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert "L256" in text and "L512" in text


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513)
    )  # vocab 258
    with pytest.raises(SystemExit, match="128,256 ids but the model only 258"):
        probe.main(
            ["--checkpoint", str(ckpt), "--tokenizer", "llama3", "--lengths", "420", "--quiet"]
        )


def test_a_consolidated_copy_has_the_checkpoints_fingerprint(tmp_path):
    """Results are keyed by the model, not by optimizer state or file layout: a consolidation shares them."""
    from posfreq.train.checkpoint import consolidate, model_fingerprint

    ckpt = write_checkpoint(tmp_path / "run", 1024, tiny_model(), np.bincount([512], minlength=513))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["optimizer"] = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}
    torch.save(state, ckpt / "state.pt")  # optimizer state beside the weights
    copy = consolidate(ckpt, tmp_path / "consolidated")
    assert model_fingerprint(copy) == model_fingerprint(ckpt)
    assert model_fingerprint(
        consolidate(ckpt, tmp_path / "bf16", dtype=torch.bfloat16)
    ) != model_fingerprint(ckpt)


def test_replace_stale_deletes_only_the_probes_own_records(tmp_path):
    """A user's files in or beside tests/ are never deleted: a tests/ folder of theirs is refused outright."""
    out = tmp_path / "out"
    (out / "tests").mkdir(parents=True)
    (out / "tests" / "test_x.py").write_text("def test(): pass\n")
    (out / "figures").mkdir()
    (out / "figures" / "mine.png").write_bytes(b"png")
    (out / "notes.md").write_text("mine\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for replace_stale in (False, True):
        with pytest.raises(
            results.StaleResults, match="tests holds files the probe did not write .*test_x.py"
        ):
            results.claim(out, "k2", {"model": "b"}, replace_stale=replace_stale)
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "tests" / "test_x.py").unlink()
    results.claim(out, "k1", {"model": "a"})
    records, marker = results.length_files(out, 128)
    records.write_text("{}\n")
    marker.write_text("{}")
    with pytest.raises(results.StaleResults, match="another key"):
        results.claim(out, "k2", {"model": "b"})
    (out / "summary.csv").write_text("the old model's table\n")
    results.claim(out, "k2", {"model": "b"}, replace_stale=True)
    assert not records.exists() and not marker.exists() and not (out / "summary.csv").exists()
    assert (out / "figures" / "mine.png").read_bytes() == b"png" and (
        out / "notes.md"
    ).read_text() == "mine\n"
    assert json.loads((out / results.KEY_FILE).read_text())["key"] == "k2"


def test_rederivation_refuses_damaged_or_mixed_records_and_writes_only_inside_its_directory(
    tmp_path, monkeypatch
):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60})
    probe_fake_run(run, out, names, [160, 256], [], monkeypatch)
    sub = out / next(iter(names))
    jsonl = results.length_files(sub, 256)[0]
    good = jsonl.read_text()
    lines = good.splitlines()

    def rederive_with(text: str, match: str) -> None:
        jsonl.write_text(text)
        with pytest.raises(results.StaleResults, match=match):
            results.derive_run(out, Analysis(), figures=False)

    rederive_with("\n".join(lines[:1]) + "\n", "1 records, but its marker says 4 tests")
    other_key = [json.loads(x) for x in lines]
    other_key[2]["key"] = "0" * 64
    rederive_with(
        "".join(json.dumps(r) + "\n" for r in other_key), "record 3: made under another key"
    )
    strings = [json.loads(x) for x in lines]
    strings[0]["hits_anywhere"] = ["false", "false", "false", "false"]
    rederive_with(
        "".join(json.dumps(r) + "\n" for r in strings), "hits_anywhere must be a list of true/false"
    )
    jsonl.write_text(good)
    results.derive_run(out, Analysis(), figures=False)  # the intact records derive again

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    meta = json.loads((out / "probe.json").read_text())
    meta["checkpoints"] = {str(elsewhere): "k"}
    (out / "probe.json").write_text(json.dumps(meta))
    with pytest.raises(results.StaleResults, match="is not a directory name inside"):
        results.derive_run(out, Analysis(), figures=False)
    assert list(elsewhere.iterdir()) == []
