#!/usr/bin/env bash
# README command 2: set up, then run the whole test suite (swarms start inside the test process, on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
