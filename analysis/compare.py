"""`python analysis/compare.py ...` is `posfreq compare ...`: the command line is posfreq/scripts/commands/compare.py."""

import sys

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by name
    sys.path.pop(0)

from posfreq.scripts.commands.compare import main

if __name__ == "__main__":
    sys.exit(main())
