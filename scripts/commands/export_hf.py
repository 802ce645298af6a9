"""Export one of our checkpoints as a Hugging Face LlamaForCausalLM directory (for lm-eval-harness, RULER, ...).

    posfreq export-hf --checkpoint CHECKPOINT --out DIR [--tokenizer llama3|bytes|hf:<dir>|none] [--dtype bfloat16]

CHECKPOINT is anything `train.checkpoint.load.load_model` reads: a consolidated model directory
(model.safetensors + model_config.json + tokenizer_spec.json) or a trainer checkpoint. The
tokenizer (default: the checkpoint's tokenizer_spec.json) gives the BOS/EOS ids and the tokenizer
files (`train.data.hf_tokenizer.write_tokenizer_files`): `llama3` and `bytes` are rebuilt offline with our exact
ids, an hf:<dir> tokenizer's files are copied, others get none (a warning says so).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal, Optional, Sequence

from posfreq.train.command_line import command_parser, parse, summary
from posfreq.train.journal import JOURNAL_FILE
from posfreq.train.model.config import DTYPES
from posfreq.train.model.hf import EXPORT_HF
from posfreq.train.outdir import OutputDirError, check_output_dir


def build_parser():
    """The command line: a checkpoint, --out, and the tokenizer and dtype to export with."""
    parser = command_parser("posfreq export-hf", summary(__doc__))
    parser.add_argument(
        "--checkpoint",
        type=str,
        required=True,
        help="consolidated model directory or trainer checkpoint directory",
    )
    parser.add_argument(
        "--out", type=str, required=True, help="output directory for the Hugging Face model"
    )
    parser.add_argument(
        "--tokenizer",
        type=Optional[str],
        default=None,
        help="tokenizer spec (llama3, bytes, hf:<dir>) or 'none' for no tokenizer; "
        "default: the checkpoint's own tokenizer_spec.json",
    )
    parser.add_argument(
        "--dtype",
        type=Optional[Literal[tuple(sorted(DTYPES))]],
        default=None,
        help="cast the weights to this dtype; default: as stored",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Load the checkpoint and write the Hugging Face directory (weights, configs, tokenizer files)."""
    from posfreq.train.checkpoint.load import check_checkpoint_tokenizer, load_model
    from posfreq.train.checkpoint.safe_load import CheckpointError
    from posfreq.train.data.hf_tokenizer import TOKENIZER_FILES, write_tokenizer_files
    from posfreq.train.data.tokenizer import get_tokenizer
    from posfreq.train.model.hf import export_hf

    args = parse(build_parser(), argv)
    try:
        check_output_dir(args.out, EXPORT_HF)  # before the (slow) load
    except OutputDirError as err:
        sys.exit(f"error: {err}")
    try:
        model, tokenizer_info, _ = load_model(
            args.checkpoint, dtype=DTYPES[args.dtype] if args.dtype else None
        )
    except CheckpointError as err:
        sys.exit(f"error: {err}")
    spec = args.tokenizer or tokenizer_info["spec"]
    bos = eos = None
    if spec != "none":
        try:
            check_checkpoint_tokenizer(
                args.checkpoint,
                tokenizer_info["spec"],
                tokenizer_info.get("fingerprint"),
                args.tokenizer,
            )
        except CheckpointError as err:
            sys.exit(f"error: {err}")
        tokenizer = get_tokenizer(spec)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise SystemExit(
                f"tokenizer {spec!r} has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}; "
                "pass the tokenizer the model was trained with (--tokenizer)"
            )
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
    older = [n for n in TOKENIZER_FILES if (Path(args.out) / n).exists()]
    if spec == "none" and older and not (Path(args.out) / JOURNAL_FILE).is_file():
        raise SystemExit(  # an earlier export's tokenizer must not pass for this one's, nor a user's be deleted
            f"error: --out {args.out} holds tokenizer files ({', '.join(older)}) and no record of who wrote them. "
            "Fix: remove them, or pass a new --out (nothing was changed)"
        )
    out = export_hf(
        model, args.out, bos_token_id=bos, eos_token_id=eos
    )  # removes the earlier export's files
    if spec != "none":
        write_tokenizer_files(spec, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
