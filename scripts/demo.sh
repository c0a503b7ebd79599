#!/usr/bin/env bash
# The main job of the README: sets up .venv (the package alone), then runs
# `shardkit demo` on data it generates in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Bytecode is cached in .venv/pycache (the project's own folder), even where the environment
# sets PYTHONDONTWRITEBYTECODE, as some container images do: there every process the tests
# start (DataLoader workers, ranks, CLI runs) compiled torch again, 6 s to import it, not 2.6.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"
exec .venv/bin/shardkit demo "$@"
