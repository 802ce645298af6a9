"""posfreq's pretraining side: data (corpora, tokenizers, shards, packing), the model and its attention,
position schemes, the trainer, checkpoints, and the checks before a cluster job (preflight).

The modules directly here are shared by every command: atomic writes, output folders, command-line
conventions, devices, the run lock, content fingerprints, reading a JSON object from disk and progress bars. Nothing in train imports analysis or scripts.
"""
