#!/usr/bin/env bash
# make gpu-check: run train/preflight/gpu_check.py with a Python that has CUDA torch, lightning and transformers.
# GPU_PY (default: .venv/bin/python where `make setup` made one, else python3) is used as it is when it can
# import posfreq; otherwise posfreq and the pure-Python packages it lacks are installed from local wheels
# (GPU_WHEELS, filled by `make gpu-wheels` on a networked machine) into GPU_SITE, with no network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${GPU_PY:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
SITE="${GPU_SITE:-.gpu-site}"
if ! "$PY" -c "import torch, lightning" 2>/dev/null; then
  echo "error: $PY cannot import torch and lightning. Fix: GPU_PY=/path/to/python make gpu-check (a Python with CUDA torch >= 2.10 and lightning)" >&2
  exit 2
fi
if ! "$PY" -c "import posfreq.train.preflight.gpu_check" 2>/dev/null; then
  mkdir -p "$SITE"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" .
  export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if ! err=$("$PY" -c "import posfreq.train.preflight.gpu_check" 2>&1); then
    echo "error: posfreq does not import with $PY: $(tail -n 1 <<<"$err"). Fix: run make gpu-wheels on a networked machine and copy $WHEELS here" >&2
    exit 2
  fi
fi
exec "$PY" -m posfreq.train.preflight.gpu_check "$@"
