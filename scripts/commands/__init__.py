"""The `posfreq` subcommands, one module each, named as they are called (`posfreq effective-length` is
effective_length.py); each holds its command line and calls the library in train/ and analysis/.

May import: anything in posfreq.
"""
