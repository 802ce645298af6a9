"""Checkpoints: the layout (the only module that knows file names), saving and verifying, safe loading,
retention and RNG state.

May import: train.model, train's shared modules.
"""
