"""Token shards on disk: tokenizing a corpus into them (`prepare`, with what a rerun keeps in `rerun`), one shard's
files written and checked (`shard_files`), and a directory of shards read as one dataset (`shards`).

May import: train's shared modules (atomic, outdir, fingerprint, journal, progress), train.data.corpora,
train.data.formats, train.data.records, train.data.stream and train.data.tokenizer.
"""
