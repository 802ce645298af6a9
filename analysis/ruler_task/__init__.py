"""RULER's eleven synthetic tasks as lm-evaluation-harness tasks that run offline (docs/ruler.md).

A folder of task files, as lm-eval reads them (`--include_path`): the YAMLs define the tasks and the
group `posfreq_ruler`; `tasks.py` makes their samples with lm-eval's own RULER generators and
`offline.py` supplies what those would download (the essay haystack, NLTK's sentence model).
`evaluate.py` runs one task at one length through lm-eval on a transformers model, and `runner.py` is what
`posfreq ruler` runs: every (task, length) part under its key (analysis/keys.py), resumable.

May import: analysis.keys, analysis.niah.settings, train.
"""
