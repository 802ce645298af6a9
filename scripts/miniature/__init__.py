"""The CPU miniature of the study behind `posfreq demo`: its corpus and tokenizer, the pipeline of stages,
the report, the agreement check between two demo runs, and the packing experiment.

May import: anything in posfreq.
"""
