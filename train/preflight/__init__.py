"""Before a cluster job: the plan (memory, accumulation, days) and the doctor (a node's smoke test), and
`make gpu-check`'s stages.

May import: every other train package.
"""
