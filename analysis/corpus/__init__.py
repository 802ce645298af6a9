"""A corpus's length histogram and its position frequency f(i) (Eq. 2): the counting job, the maths, what
each packing strategy trains, and `posfreq analyze`'s outputs, summary and figures.

May import: train.data, analysis.plots, analysis.tables.
"""
