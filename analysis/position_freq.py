"""`python analysis/position_freq.py ...` is `posfreq analyze ...`: the command line is posfreq/scripts/commands/analyze.py."""

import sys

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by name
    sys.path.pop(0)

from posfreq.scripts.commands.analyze import main

if __name__ == "__main__":
    sys.exit(main())
