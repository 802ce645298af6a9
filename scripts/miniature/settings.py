"""What sizes the demo and the experiments that run its stages: the full and quick settings of each, in one place
(scripts/miniature/pipeline.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DemoSettings:
    """Everything that sizes the demo; the full and quick modes differ only here."""

    train_lens: tuple[int, ...]
    seeds: tuple[int, ...]  # one warm-up per seed, every training length continued from it
    corpus_docs: int
    warmup_docs: int
    warmup_len: int
    warmup_tokens: int
    total_tokens: int
    checkpoint_every_tokens: int
    global_batch_tokens: int
    test_lengths: tuple[
        int, ...
    ]  # NIAH test lengths n (prompt + answer budget); a run is probed at those <= L
    tests_per_length: int
    table1_tests: int
    table1_schemes: tuple[str, ...]
    answer_budget: int = 18  # B: the 4-number answer is 16 demo-tokenizer tokens, then EOS
    string_seeds: tuple[int, ...] = (0,)  # seeds whose milestones are also probed with STRING
    strict_min_retrieved: int = (
        3  # the second pass criterion the verdicts are recomputed under (the paper's: 2 of 4)
    )
    val_docs: int = (
        2_000  # held-out documents (their own stream: the training corpora are unchanged)
    )
    val_tokens: int = (
        65_536  # validated at every milestone: val_tokens // L rows, the same tokens at every L
    )


FULL = DemoSettings(
    train_lens=(256, 512),
    seeds=(0, 1, 2),
    corpus_docs=30_000,
    warmup_docs=20_000,
    warmup_len=128,
    warmup_tokens=819_200,
    total_tokens=2_457_600,
    checkpoint_every_tokens=307_200,
    global_batch_tokens=1024,
    test_lengths=(144, 176, 208, 256, 320, 384, 448, 512),
    tests_per_length=32,
    table1_tests=50,
    table1_schemes=("rope", "string", "rerope", "self_extend", "dca", "ntk", "yarn"),
)


QUICK = DemoSettings(
    train_lens=(256, 512),
    seeds=(0,),
    corpus_docs=2_000,
    warmup_docs=500,
    warmup_len=128,
    warmup_tokens=16_384,
    total_tokens=98_304,
    checkpoint_every_tokens=32_768,
    global_batch_tokens=1024,
    test_lengths=(144, 256, 512),
    tests_per_length=4,
    table1_tests=4,
    table1_schemes=("rope", "string"),
    val_docs=200,
    val_tokens=8_192,
)


LENGTHS = replace(
    FULL,
    train_lens=(512, 1024),
    total_tokens=3_686_400,
    checkpoint_every_tokens=460_800,
    test_lengths=(144, 208, 256, 384, 512, 640, 768, 896, 1024),
)
"""The longer pair (`--experiment lengths`): the demo's design at L = 512 and 1024, where the corpus's f falls
off before L (few documents are that long), with 1.5x the demo's tokens so the longer runs can learn retrieval."""

LENGTHS_QUICK = replace(QUICK, train_lens=(512, 1024), test_lengths=(144, 512, 1024))

EXPERIMENT_SETTINGS = {"demo": (FULL, QUICK), "lengths": (LENGTHS, LENGTHS_QUICK)}
"""(full, quick) settings of each experiment that runs the demo's stages (the packing experiment has its own)."""
