"""Matplotlib figures, one function per figure: position frequency, effective length (Fig. 2), one probed
model's NIAH figures, `posfreq analyze`'s figures (corpus.py), a derivation's figures (derived.py), and the position schemes' distances.

May import: analysis.corpus.frequency, analysis.corpus.packing_prediction, analysis.niah.store (figure names), analysis.tables, train.positions,
train.run.log (its number format), train's shared modules.
"""
