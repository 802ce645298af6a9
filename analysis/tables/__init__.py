"""Tables derived from probe records: CSV and Markdown files, pass-rate curves and effective length,
one model's tables and a run's effective_length.csv (derive.py, from the probe's stored records).

May import: train's shared modules, analysis.table_files, analysis.corpus.frequency, analysis.niah.
"""
