"""The transformer and what it computes with: config presets, the modules, per-document attention and its
kernels, the chunked loss, fused elementwise parts, and Hugging Face Llama weights in and out.

May import: train.positions (the model asks its scheme how to attend), train.checkpoint.safe_load, train's shared modules.
"""
