#!/usr/bin/env bash
# The main job of the README: sets up, then runs `shardkit demo` on data it generates.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec shardkit demo "$@"
