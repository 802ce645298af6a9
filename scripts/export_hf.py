"""Export one of our checkpoints as a Hugging Face LlamaForCausalLM directory (for lm-eval-harness, RULER, ...).

    python scripts/export_hf.py CHECKPOINT OUT_DIR [--tokenizer llama3|hf:<dir>|none] [--dtype bfloat16]

CHECKPOINT is anything `train.checkpoint.load_model` reads: a consolidated model directory
(model.safetensors + model_config.json + tokenizer_spec.json) or a trainer checkpoint. The
tokenizer (default: the checkpoint's tokenizer_spec.json) gives the BOS/EOS ids; an hf:<dir>
tokenizer's files are copied, and for `llama3` a tokenizer.json with Llama 3's exact ids is built
from quicktok's bundled ranks (needs the `tokenizers` package). Other tokenizers get no files.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path


from posfreq.train.checkpoint import load_model  # noqa: E402
from posfreq.train.hf import DTYPES, export_hf, write_llama3_tokenizer  # noqa: E402
from posfreq.train.tokenizer import get_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    """Parse the command line, load the checkpoint and write the Hugging Face directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="consolidated model directory or trainer checkpoint directory")
    parser.add_argument("out_dir", help="output directory for the Hugging Face model")
    parser.add_argument("--tokenizer", default=None, help="tokenizer spec (llama3, hf:<dir>) or 'none'; default: the checkpoint's")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="cast the weights (default: as stored)")
    args = parser.parse_args(argv)
    model, tokenizer_info, _ = load_model(args.checkpoint, dtype=DTYPES[args.dtype] if args.dtype else None)
    spec = args.tokenizer or tokenizer_info["spec"]
    bos = eos = tokenizer_dir = None
    if spec != "none":
        tokenizer = get_tokenizer(spec)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer {spec!r} has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}; "
                "pass the tokenizer the model was trained with (--tokenizer)"
            )
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
        if spec.startswith("hf:"):
            tokenizer_dir = spec[3:]
        elif spec != "llama3":
            warnings.warn(f"tokenizer {spec!r} has no Hugging Face files; {args.out_dir} gets none")
    out = export_hf(model, args.out_dir, tokenizer_dir=tokenizer_dir, bos_token_id=bos, eos_token_id=eos)
    if spec == "llama3":
        write_llama3_tokenizer(out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
