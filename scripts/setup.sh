#!/usr/bin/env bash
# Installs shardkit and what its tests need into the current Python.
# torch goes first and pinned: its CPU wheel lies on this machine's disk, and a
# bare `torch` requirement could pull a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python3 -m pip install --quiet --disable-pip-version-check -e ".[dev]"
