#!/usr/bin/env bash
# The test command of the README: sets up, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q "$@"
