"""Across runs: which probed runs `posfreq compare` reads, and the computed verdicts on the paper's claims.

May import: analysis.tables, analysis.corpus.frequency, analysis.niah.store (inside functions: a probe's
records and meta; issue #47 gives the probe folder one owner), train's shared modules.
"""
