"""Position schemes: the rotary base, RoPE, STRING and the baselines (ReRoPE, Self-Extend, DCA, NTK, YaRN),
the exact log-sum-exp merge of attention passes, and the transformers adapter; one implementation per scheme.

May import: train.model.attention (the varlen kernels each pass runs on), train's shared modules.
"""
