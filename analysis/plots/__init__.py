"""Matplotlib figures, one function per figure: position frequency, effective length (Fig. 2), one probed
model's NIAH figures, a derivation's figures (derived.py), and the position schemes' distances.

May import: analysis.corpus.frequency, analysis.niah.store (figure names), analysis.tables, train.positions,
train.run.log (its number format), train's shared modules.
"""
