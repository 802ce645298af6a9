"""Test-wide setup: the scripts/ folder (demo, demo_corpus) is importable as top-level modules."""

import sys
from pathlib import Path

SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
