"""A corpus's length histogram and its position frequency f(i) (Eq. 2): the counting job, the maths, what
each packing strategy trains, and `posfreq analyze`'s outputs, summary and figures.

May import: train's shared modules, train.data, train.run.config (the packing plan reads the trainer's data
settings), train.run.log (its number format), analysis.plots, analysis.tables.
"""
