#!/usr/bin/env bash
# Installs p2ptrain and its dependencies into the current Python. Torch goes first, pinned to the CPU wheel,
# because an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
