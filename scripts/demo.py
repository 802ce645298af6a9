"""`python scripts/demo.py ...` is `posfreq demo ...`: the command line is posfreq/scripts/commands/demo.py."""

import sys

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by name
    sys.path.pop(0)

from posfreq.scripts.commands.demo import main

if __name__ == "__main__":
    sys.exit(main())
