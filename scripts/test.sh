#!/usr/bin/env bash
# The test command of the README: sets up .venv with the test extras, then runs
# the whole suite. Pass pytest arguments through, e.g. `-m "not slow"`.
#
# Tests run in one pytest-xdist worker per core (`-n auto`): most tests use one
# core, so two cores finish the suite in about half the time. `worksteal` hands
# an idle worker the queued tests of a busy one, so the long multi-process tests
# do not leave a core waiting at the end. The tests share no fixed path or port
# (tmp_path, port 0, a file store for gloo), so workers cannot collide. Give
# `-n 0` to run every test in this process, e.g. under a debugger.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q -n auto --dist worksteal "$@"
