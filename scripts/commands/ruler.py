"""`posfreq ruler`: RULER's eleven synthetic tasks on a Hugging Face model, offline, with any position scheme.

    posfreq ruler --model hf:DIR [--positions string] [--lengths 4096,8192] [--samples 500] [--out DIR]
    posfreq ruler --model hf:DIR --positions self_extend --position-options '{"group": 4}' ...

What runs and what is written: analysis/ruler_task/runner.py and docs/ruler.md.
"""

from __future__ import annotations

import sys
from typing import Sequence

from posfreq.analysis.ruler_task.settings import RulerSettings
from posfreq.train.command_line import command_parser, parse, settings_from, summary
from posfreq.train.outdir import OutputDirError


def build_parser():
    """The command line: RulerSettings' fields (the model, the position scheme, lengths, tasks, samples, how it
    runs, outputs)."""
    parser = command_parser("posfreq ruler", summary(__doc__))
    parser.add_class_arguments(RulerSettings, nested_key=None, as_group=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn a refusal into one `error:` line (exit 1)."""
    parser = build_parser()
    args = parse(parser, argv)
    try:
        settings = settings_from(RulerSettings, args)
    except ValueError as err:
        parser.error(str(err))
    # what only running needs, imported once the flags are parsed: a usage error stays instant
    from posfreq.analysis.ruler_task.evaluate import RulerError
    from posfreq.analysis.ruler_task.runner import run

    try:
        run(settings)
    except (RulerError, OutputDirError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
