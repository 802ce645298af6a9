"""`posfreq ruler`: RULER's eleven synthetic tasks on a Hugging Face model, offline, with any position scheme.

    posfreq ruler --model hf:DIR [--positions string] [--lengths 4096,8192] [--samples 500] [--out DIR]
    posfreq ruler --model hf:DIR --positions self_extend --position-options '{"group": 4}' ...

What runs and what is written: analysis/ruler_task/runner.py and docs/ruler.md.
"""

from __future__ import annotations

import sys
from typing import Literal, Optional, Sequence, Union

from posfreq.analysis.ruler_task.evaluate import RulerError
from posfreq.analysis.ruler_task.runner import TASKS, run
from posfreq.train.command_line import command_parser, parse, summary
from posfreq.train.outdir import OutputDirError
from posfreq.train.positions.schemes import SCHEMES


def build_parser():
    """The command line: the model, the position scheme, lengths, tasks, samples and outputs."""
    parser = command_parser("posfreq ruler", summary(__doc__))
    parser.add_argument(
        "--model", type=str, required=True, help="hf:DIR, a local transformers model"
    )
    parser.add_argument(
        "--positions",
        type=Literal[SCHEMES],
        default="rope",
        help="the position scheme: " + ", ".join(SCHEMES),
    )
    parser.add_argument(
        "--position-options",
        type=dict[str, Union[bool, int, float, str, None]],
        default={},
        help='the scheme\'s options as JSON, e.g. \'{"window": 512, "protocol": "paper"}\' (docs/string.md)',
    )
    parser.add_argument(
        "--shift", type=Optional[int], default=None, help="STRING's S; default L // 3"
    )
    parser.add_argument(
        "--window",
        type=Optional[int],
        default=None,
        help="STRING's W (default min(128, S // 2)), or the window of rerope and self_extend",
    )
    parser.add_argument(
        "--train-len",
        type=Optional[int],
        default=None,
        help="the training length L: STRING's defaults and the default length (config's "
        "max_position_embeddings if unset)",
    )
    parser.add_argument(
        "--lengths",
        type=Optional[str],
        default=None,
        help="prompt lengths, a comma list or START:STOP:STEP (STOP included); default L",
    )
    parser.add_argument(
        "--tasks", type=str, default="all", help=f"comma list of {', '.join(TASKS)}; or all"
    )
    parser.add_argument(
        "--samples", type=int, default=500, help="samples per task and length (RULER: 500)"
    )
    parser.add_argument(
        "--chat-template",
        type=bool,
        default=False,
        help="frame each prompt with the tokenizer's chat template (instruct models)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="prompts generated together")
    parser.add_argument("--device", type=str, default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)"
    )
    parser.add_argument(
        "--dtype",
        type=Literal["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on a CPU",
    )
    parser.add_argument(
        "--out", type=Optional[str], default=None, help="default runs/ruler/<model>-<positions>"
    )
    parser.add_argument(
        "--log-samples", type=bool, default=False, help="also write every prompt and answer"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn a refusal into one `error:` line (exit 1)."""
    parser = build_parser()
    args = parse(parser, argv)
    if args.samples < 1:
        parser.error(
            f"--samples {args.samples}: each task needs at least one sample per length. Fix: --samples 500 "
            "(RULER's), or any number >= 1"
        )
    try:
        run(args)
    except (RulerError, OutputDirError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
