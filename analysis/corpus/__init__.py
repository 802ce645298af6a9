"""A corpus's length histogram and its position frequency f(i) (Eq. 2): the counting job, the maths, what
each packing strategy trains, and `posfreq analyze`'s outputs and summary.

May import: train's shared modules, train.data, train.run.config (the packing plan reads the trainer's data
settings), train.run.log (its number format), analysis.table_files. Nothing later in analysis/ (its figures
are analysis/plots/corpus.py, passed in).
"""
