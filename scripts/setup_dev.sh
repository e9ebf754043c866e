#!/usr/bin/env bash
# Install dynprof (editable) with its test tools and the training frameworks its tests run
# (the `frameworks` extra) into the current Python environment.
# torch is the training job's own and never a dependency of dynprof: a CPU build is installed
# here only when the environment has no torch at all.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
stamp=.setup-done
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && "$PYTHON" -c "import dynprof, torch, pytest" 2>/dev/null; then
  exit 0
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "setup: no torch in this environment; installing a CPU build of torch" >&2
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi
"$PYTHON" -m pip install -q -e ".[dev,frameworks]"
touch "$stamp"
