"""Across runs: which probed runs `posfreq compare` reads, and the computed verdicts on the paper's claims.

May import: analysis.tables, analysis.table_files, analysis.corpus.frequency, analysis.niah.store (a probe's records and meta),
analysis.plots (compare's figures), train's shared modules.
"""
