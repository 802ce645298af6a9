"""Corpora and their formats, tokenizers, token shards, packing and length sampling: everything between a
corpus on disk and the packed rows a trainer reads.

May import: train's shared modules (atomic, outdir, fingerprint, command_line, devices).
"""
