"""`posfreq`: one command with a subcommand for every job, from corpus analysis to the demo.

Each subcommand is the `main(argv)` of one module, imported only when it runs (so `posfreq --help`
is instant); `posfreq SUBCOMMAND --help` lists that job's options with descriptions and defaults.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Sequence

from posfreq.train.command_line import describe_error
from posfreq.train.outdir import release_output_locks

# subcommand -> (module with main(argv), one line for `posfreq --help`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "analyze": (
        "posfreq.scripts.commands.analyze",
        "document-length histogram and position frequency f(i) of a corpus",
    ),
    "prepare": (
        "posfreq.scripts.commands.prepare",
        "tokenize a corpus into token shards for pretraining",
    ),
    "plan": (
        "posfreq.scripts.commands.plan",
        "memory, accumulation and days for a pretraining run, before submitting it",
    ),
    "pretrain": (
        "posfreq.scripts.commands.pretrain",
        "pretrain a model (Lightning Fabric; FSDP2 on GPUs)",
    ),
    "checkpoint": (
        "posfreq.scripts.commands.checkpoint",
        "list a run's checkpoints or consolidate one into model.safetensors",
    ),
    "probe": (
        "posfreq.scripts.commands.probe",
        "4-needle NIAH probe of checkpoints or a Hugging Face model",
    ),
    "effective-length": (
        "posfreq.scripts.commands.effective_length",
        "re-derive a run's effective lengths from its probe records",
    ),
    "compare": (
        "posfreq.scripts.commands.compare",
        "effective length across runs and seeds, with intervals and verdicts",
    ),
    "loss-by-distance": (
        "posfreq.scripts.commands.loss_by_distance",
        "mean next-token loss at every distance, for a checkpoint or HF model on token shards",
    ),
    "table": (
        "posfreq.scripts.commands.table",
        "the paper's Table 1 (NIAH) and Table 2 (RULER) for any model, every scheme, with intervals",
    ),
    "ruler": (
        "posfreq.scripts.commands.ruler",
        "RULER's synthetic tasks, offline, on a Hugging Face model, any position scheme",
    ),
    "export-hf": (
        "posfreq.scripts.commands.export_hf",
        "write a checkpoint as a Hugging Face Llama model directory",
    ),
    "doctor": (
        "posfreq.scripts.commands.doctor",
        "smoke-test a GPU node (NCCL pretraining, attention kernels, probe, loss) first",
    ),
    "demo": (
        "posfreq.scripts.commands.demo",
        "the CPU miniature of the whole study (train, probe, compare, report)",
    ),
}


RESUME_HINTS = {
    name: ": the same command again resumes where this one stopped (" + what + ")"
    for name, what in (
        ("prepare", "finished shards are kept"),
        ("probe", "finished tests are kept"),
        ("ruler", "finished tasks at finished lengths are kept"),
        ("table", "finished schemes and tests are kept"),
    )
}
"""What an interrupted command's line adds: the commands that resume when run again as they were."""


def usage() -> str:
    """`posfreq --help`: the subcommands and one line on each."""
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in SUBCOMMANDS.items()]
    return (
        "usage: posfreq SUBCOMMAND [options]   (posfreq SUBCOMMAND --help for its options)\n\n"
        "Why effective context length falls short of the training length: pretrain, analyse, probe, fix.\n\n"
        "subcommands:\n" + "\n".join(lines) + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch `posfreq SUBCOMMAND ...` to that module's main."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, SUBCOMMANDS, n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        print(
            f"error: unknown subcommand {name!r}; {hint}choose one of: {', '.join(SUBCOMMANDS)} "
            "(posfreq --help says what each does)",
            file=sys.stderr,
        )
        return 2
    debug = os.environ.get("POSFREQ_DEBUG") == "1" or "--debug" in rest
    rest = [a for a in rest if a != "--debug"]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    # sys.argv stays as it is: Lightning's launcher re-runs sys.argv[0] (this console script) for the other local
    # ranks, so it must remain a file that exists; each parser names itself `posfreq SUBCOMMAND`.
    try:
        try:
            return int(module.main(rest) or 0)
        except SystemExit as stop:  # a command's own message: one line that starts with "error:"
            if isinstance(stop.code, str) and not stop.code.startswith("error:"):
                raise SystemExit(f"error: {stop.code}") from None
            raise
        except KeyboardInterrupt:
            print(f"posfreq {name}: interrupted{RESUME_HINTS.get(name, '')}", file=sys.stderr)
            return 130
        except (
            Exception
        ) as err:  # every failure a command did not word itself: one line, the traceback on request
            if debug:
                raise
            print(
                f"error: {describe_error(err)}\n  (posfreq {name} --debug, or POSFREQ_DEBUG=1, shows the traceback)",
                file=sys.stderr,
            )
            return 1
    finally:
        release_output_locks()  # the command is done: its folders are free for others


if __name__ == "__main__":
    sys.exit(main())
