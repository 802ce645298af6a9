"""`python analysis/effective_length.py ...` is `posfreq effective-length ...`: the command line is posfreq/scripts/commands/effective_length.py."""

import sys

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by name
    sys.path.pop(0)

from posfreq.scripts.commands.effective_length import main

if __name__ == "__main__":
    sys.exit(main())
