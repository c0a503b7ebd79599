#!/usr/bin/env bash
# The test command of the README: sets up .venv with the test extras, then runs
# the whole suite. Pass pytest arguments through, e.g. `-m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
