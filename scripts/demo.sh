#!/usr/bin/env bash
# README command 1: set up, then train the tiny Llama on a local swarm of real processes (peers/local.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m p2ptrain.launch "$@"
