"""posfreq's analysis side: a corpus's position frequency (corpus), the NIAH probe (niah), tables and
effective length (tables), verdicts across runs (verdicts), figures (plots), result keys (keys.py), and
RULER and our NIAH task through lm-evaluation-harness.

May import train (to load a model), never scripts. The .py files directly here besides keys.py are the
documented script paths (`python analysis/position_freq.py`, ...), each running its `posfreq` subcommand.
"""
