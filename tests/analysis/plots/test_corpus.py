"""Fig. 3's note (analysis/plots/corpus.py): where and why two training lengths' curves part."""

from __future__ import annotations

import numpy as np

from posfreq.analysis.plots.corpus import fig3_note


def test_fig3_note_says_why_the_curves_part():
    L1, L2 = 256, 512
    i1, i2 = np.arange(L1), np.arange(L2)
    long_docs = {
        L1: 1e12 * (1 - i1 / L1),
        L2: 1e12 * (1 - i2 / L2),
    }  # Fig. 1c: every token in full rows
    stats = {L1: {"share_tokens_in_documents_longer_than_L": 0.9}}
    # (1 - i/256) / (1 - i/512) < 0.95 first at i = 25
    assert min(i for i in range(L1) if (1 - i / L1) / (1 - i / L2) < 0.95) == 25
    note = fig3_note(long_docs, stats)
    assert (
        "apart from i = 25" in note and "90% of the tokens are in documents longer than 256" in note
    )
    assert "i = 0" not in note and "row boundary" not in note
    assert "row boundary" in fig3_note(long_docs, stats, strategy="concat")
    stream = fig3_note(long_docs, stats, strategy="stream")
    assert "cut every 256 tokens at L = 256 but every 512 at L = 512 (where rows end);" in stream
    assert "row boundary" not in stream
    padded = {L1: 0.6 * long_docs[L1], L2: 0.3 * long_docs[L2]}
    assert fig3_note(padded, stats, padding={L1: 0.4, L2: 0.7}).startswith(
        "Apart from i = 0: padding fills 40.0% of the L = 256 rows and 70.0% of the L = 512 rows"
    )
    short_docs = {L: np.full(L, 1e12) for L in (L1, L2)}
    assert fig3_note(short_docs, stats) == "f/f(0) within 5% at every i < 256."
