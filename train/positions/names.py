"""The position schemes' names, importable without torch: command lines offer them (and settings check them) before
anything loads. train/positions/schemes.py registers one builder under each name, in this order (its tests check
that the two agree)."""

SCHEMES = ("rope", "string", "rerope", "self_extend", "dca", "ntk", "yarn")
"""Every scheme, in posfreq's own model and in any transformers model (train/positions/hf_schemes.py)."""
