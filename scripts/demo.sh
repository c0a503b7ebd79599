#!/usr/bin/env bash
# The main job of the README: sets up .venv (the package alone), then runs
# `shardkit demo` on data it generates in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/shardkit demo "$@"
