"""The resolved run: bad configs, other data and out-of-range values are refused before compute, and resuming
with another schedule needs --resume-override."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.trainer import ROOT, run, tiny

from posfreq.scripts.commands import pretrain
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.data.tokens.shard_files import ShardWriter
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.run.config import ConfigError, config_from_dict, parse_args
from posfreq.train.run.optim import lr_at
from posfreq.train.run.resolved import ResolvedRun

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_schedule_changes_on_resume_need_resume_override(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run(tiny(data_dir, out, stop_at_step=2))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out)))
    refusals = [
        (
            ["--optim.lr", "1e-3"],
            "optim.lr: checkpoint 0.003 vs now 0.001 (to change it on resume: "
            '--resume-override "{optim.lr: 0.001}")',
        ),
        (
            ["--total_tokens", "16384"],
            "total_tokens: checkpoint 8192 vs now 16384 (to change it on resume: "
            '--resume-override "{total_tokens: 16384}")',
        ),
        (
            ["--optim.beta2", "0.99"],
            "optim.beta2: checkpoint 0.95 vs now 0.99 (to continue the run as it was: --optim.beta2 0.95)\n",
        ),
        (  # the paper configs' packing changed from concat (2026-11-27): a run started before continues so
            ["--data.packing", "stream"],
            "data.packing: checkpoint 'concat' vs now 'stream' (to continue the run as it was: "
            "--data.packing concat)\n",
        ),
        (
            ["--resume-override", "{optim.beta2: 0.99}"],
            "resume_override: ['optim.beta2'] cannot change on resume; "
            "only ['optim.lr', 'optim.min_lr', 'optim.warmup_steps', "
            "'total_tokens'] can",
        ),
    ]
    for flags, expected in refusals:
        with pytest.raises(SystemExit) as refused:
            pretrain.main(["--config", str(config), *flags])
        assert str(refused.value.code).startswith("error: ") and expected in str(
            refused.value.code
        ), flags
    capsys.readouterr()
    pretrain.main(
        [
            "--config",
            str(config),
            "--optim.lr",
            "1e-3",
            "--resume-override",
            "{optim.lr: 2e-3, total_tokens: 12288}",
            "--stop-at-step",
            "3",
        ]
    )
    printed = capsys.readouterr().out
    assert (
        "resume_override: optim.lr: 0.003 -> 0.002; total_tokens: 8192 -> 12288; schedule from step 2: "
        "next LR 0.003 -> 0.002, total steps 8 -> 12"
    ) in printed  # the override wins over --optim.lr
    assert "; 12 steps" in printed
    latest = ckpt.read_trainer_state(out / "checkpoints" / ckpt.LATEST)
    assert latest["step"] == 3 and latest["schedule"]["total_steps"] == 12
    assert latest["config"]["resume_override"] == {"optim.lr": 0.002, "total_tokens": 12288}
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 3 and logged[-1]["lr"] == pytest.approx(0.002)
    # The checkpoint now holds the new values: resuming with the old file alone is refused, naming the flag.
    with pytest.raises(SystemExit) as back:
        pretrain.main(["--config", str(config)])
    assert (
        'optim.lr: checkpoint 0.002 vs now 0.003 (to change it on resume: --resume-override "{optim.lr: 0.003}")'
        in str(back.value.code)
    )


@pytest.mark.slow
def test_bad_configs_fail_before_compute(data_dir, tmp_path):
    out = tmp_path / "run"
    cases = [
        (
            tiny(data_dir, out, optim={"lrr": 1.0}),
            "Group 'optim' does not accept option 'lrr'",
        ),
        (
            tiny(data_dir, out, data={"dir": str(tmp_path / "missing"), "train_len": 128}),
            "does not exist",
        ),
        (tiny(data_dir, out, data={"dir": "", "train_len": 128}), "data.dir is empty"),
        (
            tiny(data_dir, out, resume="none"),
            "resume=none: no checkpoint directory none. Fix: --resume null to start afresh",
        ),
        (tiny(data_dir, out, global_batch_tokens=1000), "not a whole number of micro-batches"),
        (tiny(data_dir, out, micro_batch_rows=3), "not a whole number of micro-batches"),
        (
            tiny(data_dir, out, **{"model.overrides.train_len": 4096}),
            "the training length has one name",
        ),
        (
            tiny(data_dir, out, **{"data.length_upsample": {"0-100000": 0.0}}),
            "gives every document of data.dir",
        ),
        (
            tiny(data_dir, out, seed="x"),
            "Parser key \"seed\":\n  Expected a <class 'int'>. Got value: x",
        ),
    ]
    (tmp_path / "empty").mkdir()
    cases.append(
        (
            tiny(data_dir, out, data={"dir": str(tmp_path / "empty"), "train_len": 128}),
            "no token shards",
        )
    )
    cases.append(
        (
            tiny(data_dir, out, **{"data.val_dir": str(tmp_path / "empty")}),
            "data.val_dir: .*no token shards",
        )
    )
    cases.append(
        (
            tiny(data_dir, out, **{"data.val_dir": str(tmp_path / "missing")}),
            "data.val_dir: .*does not exist",
        )
    )
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            ResolvedRun(config_from_dict(cfg), world_size=1)

    run(tiny(data_dir, tmp_path / "a", total_tokens=1024, **{"checkpoint.latest_every_steps": 1}))
    changed = tiny(data_dir, tmp_path / "a", total_tokens=1024, **{"optim.lr": 1e-3})
    with pytest.raises(
        ConfigError, match="different config:\n  optim.lr: checkpoint 0.003 vs now 0.001"
    ):
        ResolvedRun(config_from_dict(changed), world_size=1)
    # Run-time settings may change on resume; the schedule only through resume_override.
    ResolvedRun(
        config_from_dict(tiny(data_dir, tmp_path / "a", micro_batch_rows=2, total_tokens=1024)), 1
    )
    with pytest.raises(
        ConfigError,
        match=r"total_tokens: checkpoint 1024 vs now 4096 \(to change it on resume: "
        r"--resume-override \"\{total_tokens: 4096\}\"\)",
    ):
        ResolvedRun(config_from_dict(tiny(data_dir, tmp_path / "a", total_tokens=4096)), 1)
    ResolvedRun(
        config_from_dict(tiny(data_dir, tmp_path / "a", resume_override={"total_tokens": 4096})), 1
    )


def test_cli_overrides_and_schedule(data_dir):
    cfg = parse_args(
        [
            "--config",
            str(ROOT / "configs/pretrain_2k.yaml"),
            "--optim.lr",
            "1e-3",
            "--data.dir",
            str(data_dir),
            "--checkpoint.sharded",
            "false",
        ]
    )
    assert (
        cfg.optim.lr == 1e-3 and cfg.data.dir == str(data_dir) and cfg.checkpoint.sharded is False
    )
    assert cfg.global_batch_tokens == 4_194_304 and cfg.total_tokens == 10**12
    lrs = [lr_at(s, cfg, 238_419) for s in (0, 1999, 2000, 120_000, 238_418, 300_000)]
    assert (
        lrs[0] == pytest.approx(1e-3 / 2000)
        and lrs[1] == pytest.approx(1e-3)
        and lrs[2] == pytest.approx(1e-3)
    )
    assert cfg.optim.min_lr < lrs[3] < 1e-3 and lrs[4] == pytest.approx(cfg.optim.min_lr, rel=1e-6)
    assert lrs[5] == cfg.optim.min_lr


def test_resume_refuses_other_documents_with_the_same_counts(resumable, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    moved = shutil.copytree(data_dir, tmp_path / "moved")  # the same shards elsewhere: fine
    other = tmp_path / "other"  # same shard names, document and token counts; other documents
    shutil.copytree(data_dir, other)
    docs = TokenDataset(data_dir)
    with ShardWriter(other, "shard-000", tokenizer="bytes", vocab_size=258, eos_id=257) as writer:
        for i in reversed(range(150)):
            writer.add(docs.document(i))
    assert (TokenDataset(other).num_docs, TokenDataset(other).num_tokens) == (
        docs.num_docs,
        docs.num_tokens,
    )
    assert (
        ResolvedRun(
            config_from_dict(tiny(data_dir, out, **{"data.dir": str(moved)})), 1
        ).resume_from
        == out / "checkpoints" / ckpt.LATEST
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"data.dir": str(other)})))
    with pytest.raises(SystemExit) as refused:
        pretrain.main(["--config", str(config)])
    message = str(refused.value.code)
    assert message.startswith(
        f"error: resume: {out / 'checkpoints' / ckpt.LATEST} was trained on data.dir "
        f"{data_dir} (data fingerprint "
    ), message
    assert (
        f"but data.dir {other} holds other documents" in message
        and "Fix: set --data.dir" in message
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, value, message",
    [
        (
            "--micro_batch_rows",
            "0",
            "micro_batch_rows=0 is out of range: it must be a finite number >= 1",
        ),
        (
            "--logging.every_steps",
            "0",
            "logging.every_steps=0 is out of range: it must be a finite number >= 1",
        ),
        ("--total_tokens", "0", "total_tokens=0 is out of range: it must be a finite number >= 1"),
        (
            "--total_tokens",
            "-5",
            "total_tokens=-5 is out of range: it must be a finite number >= 1",
        ),
        ("--optim.lr", "-1", "optim.lr=-1.0 is out of range: it must be a finite number >= 0"),
        ("--optim.lr", ".inf", "optim.lr=inf is out of range: it must be a finite number >= 0"),
        (
            "--total_tokens",
            str(10**29),
            "total_tokens=99,999,999,999,999,991,433,150,857,216 is out of range: it must be at "
            "most 2^53 (9,007,199,254,740,992 tokens)",  # 10^29 as the float a YAML number becomes
        ),
        ("--model.overrides", "{d_model: x}", "model.overrides.d_model='x' should be a number"),
        (
            "--model.overrides",
            "{n_heads: 0}",
            "model.overrides (preset 'tiny-2l-128'): n_heads=0 is out of range: it must be >= 1",
        ),
    ],
)
def test_out_of_range_values_are_named_before_anything_runs(
    data_dir, tmp_path, flag, value, message
):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, tmp_path / "run")))
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main(["--config", str(config), flag, value])
    assert exit_info.value.code == f"error: {config} + command-line overrides: {message}"
    assert not (tmp_path / "run").exists()


def test_no_rank_reads_every_document_offset_before_launch(resumable, data_dir, tmp_path):
    """Every rank of a cluster job resolves the run before launch; the data fingerprint (every document offset of
    every shard read) waits for rank 0's check after launch, which refuses other documents as before
    (test_resume_refuses_other_documents_with_the_same_counts)."""
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    run = ResolvedRun(config_from_dict(tiny(data_dir, out)), 1, hashes=False)
    assert run.resume_from == out / "checkpoints" / ckpt.LATEST
    assert "data_fingerprint" not in vars(run)  # not computed
    assert run.checksum_verdict() == {"resume_from": str(run.resume_from), "skipped": []}
    assert "data_fingerprint" in vars(run)  # rank 0's check computed it


def test_shards_whose_tokenizer_folder_is_gone_are_refused_with_the_rerun_that_relabels_them(
    tmp_path,
):
    """Shards naming an hf:DIR that is not there (the data or the folder moved) gave checkpoints a tokenizer record
    without its content fingerprint, silently, and the probe could not load it: refused at start, naming the
    folder and prepare's rerun."""
    data = tmp_path / "data"
    gone = tmp_path / "moved-away" / "T"
    with ShardWriter(
        data, "shard-000", tokenizer=f"hf:{gone}", vocab_size=258, eos_id=257
    ) as writer:
        for i in range(40):
            writer.add(list(range(i % 7, i % 7 + 60)) + [257])
    with pytest.raises(ConfigError) as refused:
        ResolvedRun(config_from_dict(tiny(data, tmp_path / "run")), 1)
    message = str(refused.value)
    assert f"were tokenized with hf:{gone}, which is not there now" in message
    assert "Fix: rerun posfreq prepare" in message and "--tokenizer hf:<its new folder>" in message


def test_shards_naming_their_tokenizer_json_file_itself_are_not_refused_as_gone(tmp_path):
    """hf:DIR/tokenizer.json (the file) is a spec the tokenizer loads and prepare records; the refusal of a gone
    folder asked whether it was a directory, so such shards were refused though the file was there."""
    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer

    write_bytes_tokenizer(tmp_path / "T")
    spec = f"hf:{tmp_path / 'T' / 'tokenizer.json'}"
    data = tmp_path / "data"
    with ShardWriter(data, "shard-000", tokenizer=spec, vocab_size=258, eos_id=257) as writer:
        for i in range(40):
            writer.add(list(range(i % 7, i % 7 + 60)) + [257])
    run = ResolvedRun(config_from_dict(tiny(data, tmp_path / "run")), 1)
    assert run.tokenizer_spec["spec"] == spec and run.tokenizer_spec["fingerprint"]
