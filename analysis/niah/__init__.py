"""The 4-needle NIAH probe: test construction and scoring, settings and result keys, model sources,
decoding (posfreq's engine and transformers), the runner and the result store.

May import: train, analysis.tables, analysis.plots, analysis.corpus.frequency.
"""
