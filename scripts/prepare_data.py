"""`python scripts/prepare_data.py ...` is `posfreq prepare ...`: the command line is posfreq/scripts/commands/prepare.py."""

import sys

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by name
    sys.path.pop(0)

from posfreq.scripts.commands.prepare import main

if __name__ == "__main__":
    sys.exit(main())
