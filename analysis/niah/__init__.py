"""The 4-needle NIAH probe: test construction and scoring, settings and result keys, model sources,
decoding (posfreq's engine and transformers), the runner and the result store (store.py: the one owner of
the result folder's file names).

May import: train, analysis.keys (nothing later in analysis/: tests/test_layout.py checks the order).
"""
