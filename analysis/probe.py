"""`python analysis/probe.py ...` is `posfreq probe ...`: the command line is posfreq/scripts/commands/probe.py."""

import sys

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by name
    sys.path.pop(0)

from posfreq.scripts.commands.probe import main

if __name__ == "__main__":
    sys.exit(main())
