"""RULER's eleven synthetic tasks for lm-eval, offline: the functions the task YAMLs beside this file name.

Samples are made by lm-eval's own RULER generators (`lm_eval.tasks.ruler`), with the parameters of
its task list; only the essay haystack and the sentence model come from `offline.py` instead of the
network. Each (task, length) is seeded by its own name, so a task's samples do not depend on which
other tasks run with it. Task options arrive as lm-eval metadata (`--metadata` or TaskManager's):
`tokenizer` (or `pretrained`), `max_seq_lengths` (default [4096], as lm-eval's RULER) and
`num_samples` per length (default 500, as RULER).
"""

from __future__ import annotations

import contextlib
import random
import zlib
from typing import Any, Callable, Iterator

import numpy as np

from posfreq.analysis.ruler_task.offline import essay_haystack, use_offline_data

use_offline_data()  # before lm-eval's RULER modules import NLTK's sentence splitter

from lm_eval.tasks.ruler import common_utils, cwe_utils, fwe_utils, prepare_niah, vt_utils  # noqa: E402

DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 500

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
    "magic {type_needle_v} for {query} mentioned in the provided text?"
)
"""RULER's NIAH prompt (lm-eval's niah_utils.TEMPLATE)."""

NIAH_TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": dict(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers"),
    "niah_single_2": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers"),
    "niah_single_3": dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids"),
    "niah_multikey_1": dict(
        type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=4
    ),
    "niah_multikey_2": dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_3": dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
    "niah_multivalue": dict(
        type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_v=4
    ),
    "niah_multiquery": dict(
        type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_q=4
    ),
}
"""lm-eval's RULER NIAH variants (niah_utils.py), by the names of its task list."""


def _niah(task: str) -> Callable[[Any, int, int], list[dict]]:
    params = NIAH_TASKS[task]

    def build(tokenizer: Any, length: int, samples: int) -> list[dict]:
        kind = params["type_haystack"]
        haystack = essay_haystack() if kind == "essay" else prepare_niah.get_haystack(kind)
        if kind == "essay":
            require_haystack(tokenizer, length)
        return prepare_niah.generate_samples(
            haystack,
            TOKENIZER=tokenizer,
            max_seq_length=length,
            template=NIAH_TEMPLATE,
            num_samples=samples,
            **params,
        )

    return build


def require_haystack(tokenizer: Any, length: int) -> None:
    """Refuse a length the shipped essays cannot fill (lm-eval would quietly make shorter prompts)."""
    available = len(tokenizer(" ".join(essay_haystack())).input_ids)
    if available < length:
        raise ValueError(
            f"RULER's essay haystack (the essays posfreq ships) is {available} tokens of this tokenizer, "
            f"too few for {length}-token prompts. Fix: ask for lengths up to {available}"
        )


VT_EXAMPLE_LENGTH = 500
"""RULER's budget for variable tracking's in-context example, in tokens."""


LONGER = (
    "ask for longer lengths (posfreq ruler --lengths; max_seq_lengths in lm-eval's metadata), or leave this "
    "task out"
)


def require_fit(
    task: str, smallest: list[int], reserved: int, length: int, fix: str = LONGER
) -> None:
    """Refuse a length that cannot hold `task`'s smallest prompt (its token ids) and `reserved` tokens (lm-eval's
    generators would search for a smaller one forever)."""
    if len(smallest) + reserved > length:
        raise ValueError(
            f"RULER's {task} does not fit in {length} tokens: its smallest prompt takes {len(smallest)} "
            f"tokens of this tokenizer and {reserved} more are reserved. Fix: {fix}"
        )


def _vt_example(tokenizer: Any, length: int) -> dict:
    """vt's in-context example, once it and vt's smallest prompt are known to fit (ValueError if not)."""

    def smallest() -> list[int]:
        with seeded("vt smallest"):  # off the samples' random stream
            text, answer = vt_utils.generate_input_output(5, 1, 4, is_icl=True)
        return tokenizer(f"{text} {answer}").input_ids

    fixed = "RULER gives vt's example a fixed budget whatever the length: leave vt out (--tasks)"
    require_fit("vt (its in-context example)", smallest(), 30, VT_EXAMPLE_LENGTH, fixed)
    example = vt_utils.sys_vartrack_w_noise_random(
        tokenizer=tokenizer, num_samples=1, max_seq_length=VT_EXAMPLE_LENGTH, incremental=5
    )[0]
    shown = f"{example['input']} {' '.join(example['outputs'])}\n\n"
    require_fit("vt", smallest() + tokenizer(shown).input_ids, 30, length)
    return example


def _variable_tracking(tokenizer: Any, length: int, samples: int) -> list[dict]:
    example = _vt_example(tokenizer, length)
    return vt_utils.sys_vartrack_w_noise_random(
        tokenizer=tokenizer, num_samples=samples, max_seq_length=length, icl_example=example
    )


def _cwe_fit(tokenizer: Any, length: int) -> None:
    with seeded("cwe smallest"):  # off the samples' random stream
        example, text, _ = cwe_utils.generate_input_output(10, length)
    require_fit("cwe", tokenizer(f"{example}\n{text}").input_ids, 120, length)


def _common_words(tokenizer: Any, length: int, samples: int) -> list[dict]:
    _cwe_fit(tokenizer, length)
    return cwe_utils.sys_word_pair_random(
        num_samples=samples, max_seq_length=length, tokenizer=tokenizer
    )


def _frequent_words(tokenizer: Any, length: int, samples: int) -> list[dict]:
    return fwe_utils.sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=samples)


BUILDERS: dict[str, Callable[[Any, int, int], list[dict]]] = {
    **{task: _niah(task) for task in NIAH_TASKS},
    "vt": _variable_tracking,
    "cwe": _common_words,
    "fwe": _frequent_words,
}
"""The eleven synthetic tasks: (tokenizer, length, samples per length) -> lm-eval's sample records."""


def _fits(task: str, tokenizer: Any, length: int) -> None:
    """ValueError when `task` cannot make a prompt of `length` tokens with this tokenizer (what its builder checks
    first), without making its samples."""
    if task == "vt":
        _vt_example(tokenizer, length)
    elif task == "cwe":
        _cwe_fit(tokenizer, length)
    elif NIAH_TASKS.get(task, {}).get("type_haystack") == "essay":
        require_haystack(tokenizer, length)


def misfits(tokenizer: Any, tasks: list[str], lengths: list[int]) -> list[str]:
    """Every (task, length) that cannot run, each as its reason: checked before any evaluation, so a run stops at
    once instead of after the tasks that fit."""
    problems = []
    for task in tasks:
        for length in lengths:
            try:
                with seeded(
                    f"fit {task}:{length}"
                ):  # samples_for reseeds: the samples are unchanged
                    _fits(task, tokenizer, length)
            except ValueError as err:
                problems.append(f"{task} at {length}: {err}")
    return problems


@contextlib.contextmanager
def seeded(name: str) -> Iterator[None]:
    """The generators' random streams (Python's and numpy's global ones, and cwe's module-level RNG,
    which otherwise carries over between calls) seeded from `name`, then restored."""
    states = random.getstate(), np.random.get_state(), cwe_utils.RNG.getstate()
    seed = zlib.crc32(name.encode())
    random.seed(seed)
    np.random.seed(seed)
    cwe_utils.RNG.seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        cwe_utils.RNG.setstate(states[2])


def samples_for(task: str, tokenizer: Any, length: int, samples: int) -> list[dict]:
    """`samples` records of `task` at `length` tokens, the same on every run and machine."""
    with seeded(f"{task}:{length}"):
        return BUILDERS[task](tokenizer, length, samples)


def dataset(task: str, **metadata: Any) -> dict[str, Any]:
    """lm-eval's custom_dataset hook: the test split of `task` over every length asked for."""
    import datasets

    tokenizer = common_utils.get_tokenizer(common_utils.resolve_tokenizer_name(metadata))
    lengths = metadata.get("max_seq_lengths") or DEFAULT_LENGTHS
    samples = int(metadata.get("num_samples") or DEFAULT_SAMPLES)
    records = [row for n in lengths for row in samples_for(task, tokenizer, int(n), samples)]
    return {"test": datasets.Dataset.from_list(records, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's score (the share of reference strings found in the answer), under the sample's length."""
    answer = common_utils.postprocess_pred(results)
    return {str(doc["max_length"]): common_utils.string_match_all(answer, [doc["outputs"]])}
