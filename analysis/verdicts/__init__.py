"""Across runs: which probed runs `posfreq compare` reads, and the computed verdicts on the paper's claims.

May import: analysis.tables, analysis.corpus.frequency, train's shared modules.
"""
