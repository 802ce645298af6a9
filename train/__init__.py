"""posfreq's pretraining package: tokenizer, model, per-document attention, packing, trainer."""
