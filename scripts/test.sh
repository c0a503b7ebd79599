#!/usr/bin/env bash
# The test command of the README: sets up .venv with the test extras, then runs
# the whole suite. Pass pytest arguments through, e.g. `-m "not slow"`.
#
# Tests run in pytest-xdist workers, one per core and one more (`-n <cores+1> --dist
# worksteal`): a test spends part of its time waiting (DataLoader workers and ranks
# starting, gloo rendezvous, loopback servers), so with one worker per core the cores
# were busy 1.75 of 2 on average; the extra worker fills that (whole suite 7 min 8 s ->
# 6 min 15 s in the same hour on 2 cores). They share no fixed path or port, every
# subprocess they start has a bound that prints its stacks and kills its session, and
# each test has pytest-timeout's 300 s. `-n 0` after it runs them in this one process
# (a debugger, `-x` in order).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# Bytecode is cached in .venv/pycache (the project's own folder), even where the environment
# sets PYTHONDONTWRITEBYTECODE, as some container images do: there every process the tests
# start (DataLoader workers, ranks, CLI runs) compiled torch again, 6 s to import it, not 2.6.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"
workers=$(( $(nproc 2>/dev/null || echo 1) + 1 ))
exec .venv/bin/python -m pytest -q -n "$workers" --dist worksteal "$@"
