"""`posfreq loss-by-distance`: the mean next-token loss at every distance from the document's start, for one of
our checkpoints or a Hugging Face model, on any prepared token shards.

    posfreq loss-by-distance --checkpoint RUN/checkpoints/tokens-... --data DIR [--rows 64] --out DIR
    posfreq loss-by-distance --model hf:DIR --data DIR --train-len 2048 --out DIR
    posfreq loss-by-distance --model hf:DIR --engine transformers --data DIR --train-len 4096 --out DIR

A Hugging Face model runs imported into posfreq's model (Llama and Mistral: packed rows, one forward per batch)
or, with --engine transformers, as transformers loads it (any causal LM, Qwen2 too: a forward per document
piece, from position 0, which is what attention within documents computes).

The rows are the first --rows packed rows of --data, in order, as the trainer's validation packs them; the
buckets are train/run/loss_by_distance.py's. Writes loss_by_distance.json (the table and what made it),
loss_by_distance.csv (a row per bucket: distances, tokens, mean loss, and f at that distance when the
checkpoint carries its trained-length histogram) and loss_by_distance.png/.pdf.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal, Optional, Sequence

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.analysis.plots.losses import plot_loss_by_distance
from posfreq.analysis.table_files import write_csv
from posfreq.analysis.tables.columns import LOSS_BY_DISTANCE_COLUMNS
from posfreq.train.atomic import write_json_atomic
from posfreq.train.checkpoint.load import (
    check_checkpoint_tokenizer,
    load_model,
    read_checkpoint_info,
    run_record,
)
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.command_line import command_parser, parse, summary
from posfreq.train.data.hf_tokenizer import same_tokenizer
from posfreq.train.data.packing_strategies import STRATEGIES
from posfreq.train.data.tokenizer import absolute_spec, get_tokenizer, hf_dir
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.devices import resolve_device
from posfreq.train.outdir import OutputDirError, check_output_dir, claim_output_dir
from posfreq.train.run.config import DataSection
from posfreq.train.run.loss_by_distance import ScoredRows, check_rows, measure

COMMAND = "loss-by-distance"


def build_parser():
    """The command line: one model, the token shards, how many rows of what length, and --out."""
    parser = command_parser(f"posfreq {COMMAND}", summary(__doc__))
    parser.add_argument(
        "--checkpoint",
        type=Optional[str],
        default=None,
        help="one of our checkpoints (trainer milestone or consolidated directory)",
    )
    parser.add_argument(
        "--model",
        type=Optional[str],
        default=None,
        help="hf:DIR, a local Hugging Face Llama-family model (imported into posfreq's model)",
    )
    parser.add_argument(
        "--engine",
        type=Literal["posfreq", "transformers"],
        default="posfreq",
        help="for --model: posfreq imports a Llama-family model; transformers runs any causal LM as loaded",
    )
    parser.add_argument(
        "--tokenizer",
        type=Optional[str],
        default=None,
        help="for --checkpoint: the tokenizer spec instead of the one it recorded (a run whose hf:DIR moved), "
        "checked by content against the run's record",
    )
    parser.add_argument(
        "--data",
        type=str,
        required=True,
        help="token shards (posfreq prepare), the model's tokenizer",
    )
    parser.add_argument(
        "--train-len",
        type=Optional[int],
        default=None,
        help="tokens per packed row, >= 1 (null: the model's training length)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=64,
        help="packed rows measured (from the first); at most the rows the data fills once at --train-len",
    )
    parser.add_argument("--batch-rows", type=int, default=4, help="rows per forward pass")
    parser.add_argument(
        "--packing",
        type=Optional[Literal[tuple(STRATEGIES)]],
        default=None,
        help="how documents fill the rows, as the trainer's data.packing (null: the checkpoint's run's, "
        "as its validation packed them; concat for --model)",
    )
    parser.add_argument("--device", type=str, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", type=str, required=True, help="output directory")
    return parser


def load(args) -> tuple:
    """(model, tokenizer spec, trained-length histogram or None, label, run state or None) of --checkpoint or
    --model."""
    if args.checkpoint is not None:
        info = read_checkpoint_info(args.checkpoint)
        check_checkpoint_tokenizer(  # the one it trained with, by content
            args.checkpoint, info.tokenizer_spec, info.tokenizer_fingerprint, args.tokenizer
        )
        model, spec, meta = load_model(args.checkpoint)
        spec = args.tokenizer or spec["spec"]
        return model, spec, info.trained_lengths, Path(args.checkpoint).name, meta
    directory = hf_dir(args.model)
    if directory is None:
        raise ValueError(f"--model {args.model}: give a local folder as hf:DIR")
    if args.engine == "transformers":
        from posfreq.train.positions.hf_schemes import load_causal_lm

        model = load_causal_lm(directory)
    else:
        from posfreq.train.model.hf import load_hf_model

        model = load_hf_model(directory).eval()
    return model, f"hf:{directory.resolve()}", None, directory.name, None


def run_packing(meta: dict | None, checkpoint: str | None) -> str:
    """The data.packing a checkpoint's run trained and validated with (`meta`, its run state as load_model read
    it), else the trainer's default."""
    default = DataSection.__dataclass_fields__["packing"].default
    config = (meta or {}).get("config")
    data = config.get("data") if isinstance(config, dict) else None
    packing = data.get("packing", default) if isinstance(data, dict) else default
    if packing not in STRATEGIES:
        raise ValueError(
            f"{run_record(Path(checkpoint))}: data.packing {packing!r} is not one of {sorted(STRATEGIES)}. "
            "Fix: pass --packing"
        )
    return packing


def _fingerprint(spec: str) -> str | None:
    """The content fingerprint of the tokenizer `spec` names, None where it cannot be loaded here."""
    try:
        return get_tokenizer(spec).fingerprint
    except (ValueError, ImportError, OSError):
        return None


def check_data_tokenizer(dataset: TokenDataset, spec: str, vocab_size: int) -> None:
    """ValueError unless `dataset` was tokenized by the model's tokenizer (`spec`, `vocab_size`), compared by
    content: as prepare recorded it, else the content of the tokenizer the shards name."""
    recorded = dataset.shards[0].meta.get("tokenizer_fingerprint") or _fingerprint(
        dataset.tokenizer
    )
    same = (
        same_tokenizer(recorded, get_tokenizer(spec))
        if recorded is not None
        else absolute_spec(dataset.tokenizer) == absolute_spec(spec)
    )
    if not same or dataset.vocab_size > vocab_size:
        raise ValueError(
            f"--data {dataset.directory} was tokenized with {dataset.tokenizer!r}, not the model's tokenizer "
            f"{spec!r}. Fix: prepare the corpus with the model's tokenizer (posfreq prepare --tokenizer)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, measure, write the table, the CSV and the figure; `error:` lines for what cannot run."""
    parser = build_parser()
    args = parse(parser, argv)
    for name in ("rows", "batch_rows", "train_len"):
        if args[name] is not None and args[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {args[name]}")
    if (args.checkpoint is None) == (args.model is None):
        parser.error("pass exactly one of --checkpoint PATH and --model hf:DIR")
    if args.tokenizer is not None and args.model is not None:
        parser.error("--tokenizer is for --checkpoint; a --model hf:DIR reads its own tokenizer")
    if args.engine == "transformers" and args.model is None:
        parser.error("--engine transformers runs a Hugging Face model: pass --model hf:DIR")
    try:
        check_output_dir(args.out, COMMAND)  # a user's folder is refused before the model loads
        device = resolve_device(args.device)
        model, spec, trained, label, meta = load(args)
        dataset = TokenDataset(args.data)
        check_data_tokenizer(dataset, spec, model.config.vocab_size)
        per_segment = args.engine == "transformers"
        packing = args.packing or run_packing(meta, args.checkpoint)
        train_len = args.train_len
        if train_len is None:  # the model's own length (0 is refused above, not taken for "unset")
            train_len = (
                model.config.max_position_embeddings if per_segment else model.config.train_len
            )
        scored = ScoredRows(dataset, train_len, args.rows, args.batch_rows, packing)
        sampler = check_rows(scored)
        out = claim_output_dir(args.out, COMMAND)  # claimed once nothing is left to refuse
        table = measure(model.to(device), scored, device, per_segment, sampler)
        if not np.isfinite(table.loss_sum).all():
            raise ValueError(
                f"{label}: a non-finite loss in {args.rows} rows of {train_len} tokens of {args.data}: its mean loss "
                "by distance would be NaN printed as a number. Fix: check the model's weights (an overflow in its "
                "activations), or measure another checkpoint"
            )
    except (ValueError, OSError, OutputDirError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    mean = table.mean()
    f = position_frequency(trained, len(trained) - 1) if trained is not None else None
    rows = [
        {
            "distance_lo": int(lo),
            "distance_hi": int(hi) - 1,
            "tokens": int(n),
            "mean_loss": "" if n == 0 else float(m),
            "f_distance_lo": "" if f is None or lo >= len(f) else float(f[lo]),
        }
        for lo, hi, n, m in zip(table.edges[:-1], table.edges[1:], table.tokens, mean)
    ]
    write_csv(out / "loss_by_distance.csv", rows, LOSS_BY_DISTANCE_COLUMNS)
    made_of = {"model": args.checkpoint or args.model, "data": args.data, "rows": args.rows}
    made_of |= {"train_len": train_len, "packing": packing, "tokenizer": spec}
    made_of |= {"engine": args.engine}
    write_json_atomic(out / "loss_by_distance.json", {**made_of, **table.to_dict()}, indent=1)
    plot_loss_by_distance({label: (table.edges, mean)}, out / "loss_by_distance", title=label)
    held = mean[table.tokens > 0]
    print(
        f"{int(table.tokens.sum()):,} targets in {args.rows} rows of {train_len}: mean loss {held[0]:.3f} at "
        f"distance 0, {held[-1]:.3f} at the farthest bucket; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
