"""Matplotlib figures, one function per figure: position frequency, effective length (Fig. 2), one probed
model's NIAH figures, and the position schemes' distances.

May import: analysis.corpus.frequency, analysis.tables, train.positions.
"""
