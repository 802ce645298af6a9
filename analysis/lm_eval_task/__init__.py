"""posfreq's 4-needle NIAH probe as an lm-evaluation-harness task (see make_tests.py and docs/interop.md).

`make_tests.py` writes the probe's exact tests at the lengths asked for as local JSONL files, one
task YAML per length (each includes `posfreq_niah.yaml`, the shared task definition) and a group
`posfreq_niah` over them; `scoring.py` scores lm-eval's greedy answers as `posfreq probe` does.
A folder of task files rather than code in the package: lm-eval reads YAML and loads the
functions they name from files beside them.

May import: analysis.niah (the probe's tests and scoring), train.
"""
