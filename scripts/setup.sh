#!/usr/bin/env bash
# Sets up the project's own environment in .venv (git-ignored) and installs
# shardkit into it: `setup.sh` for the package alone, `setup.sh dev` with the
# test extras. pip runs only when pyproject.toml (or the extras asked for)
# changed since the last install, so a second run starts at once; so do setup.py
# and the C decoder's source, which pip compiles into the package.
# torch goes first and pinned: its CPU wheel lies on this machine's disk, and a
# bare `torch` requirement could pull a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv=.venv
if [[ ! -x "$venv/bin/python" ]]; then
    echo "shardkit: creating the project environment in $PWD/$venv" >&2
    python3 -m venv "$venv"
fi
want="$(cat pyproject.toml setup.py shardkit/formats/_example.c scripts/setup.sh | sha256sum | cut -c1-16) ${extras:-core}"
stamp="$venv/.shardkit-installed"
if [[ -f "$stamp" ]] && grep -qxF "$want" "$stamp"; then
    exit 0
fi
echo "shardkit: installing into $PWD/$venv (${extras:-core})" >&2
# --no-compile: pip would byte-compile every module of torch, transformers, lightning... (most
# never imported here); Python compiles what is imported on first use and caches it.
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
"${pip[@]}" "torch==2.13.0"
# editable_mode=compat puts the checkout itself on sys.path (a .pth entry), so
# a clone run from its parent folder imports the package, not the clone folder
# as an empty namespace package.
editable=(--config-settings editable_mode=compat -e)
if [[ -n "$extras" ]]; then
    "${pip[@]}" "${editable[@]}" ".[$extras]"
else
    "${pip[@]}" "${editable[@]}" .
fi
# A dev install also satisfies a later core-only run: remember both. (An
# `if`, not `[[ ]] &&`: a last command with status 1 would fail the script.)
{
    echo "$want"
    if [[ -n "$extras" ]]; then echo "${want% *} core"; fi
} > "$stamp"
