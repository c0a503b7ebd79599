#!/usr/bin/env bash
# The test command of the README: sets up .venv with the test extras, then runs
# the whole suite. Pass pytest arguments through, e.g. `-m "not slow"`.
#
# Tests run in this one process by default. `-n auto --dist worksteal` runs
# them in one pytest-xdist worker per core (the quick suite in about half the
# time; the tests share no fixed path or port), but on 2 cores one of two full runs
# hung in tests/even's gloo check of a corrupt record raised on one rank
# (not reproduced alone; open in the tracker), so CI does not use it yet.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
