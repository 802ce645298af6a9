"""One pretraining run: its config and resolution, the trainer loop, optimiser, parallelism, validation,
logging, run control and FLOPs.

May import: every other train package.
"""
