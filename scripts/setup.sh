#!/usr/bin/env bash
# Sets up the project's own environment in .venv (git-ignored) and installs
# shardkit into it: `setup.sh` for the package alone, `setup.sh dev` with the
# test extras. pip runs only when pyproject.toml (or the extras asked for)
# changed since the last install, so a second run starts at once; so do setup.py
# and the C sources (tf.Example decoder, TFRecord kernel), compiled into the package.
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
want="$(cat pyproject.toml setup.py shardkit/formats/_example.c shardkit/formats/_tfrecord.c scripts/setup.sh | sha256sum | cut -c1-16) ${extras:-core}"
stamp="$venv/.shardkit-installed"
if [[ -f "$stamp" ]] && grep -qxF "$want" "$stamp"; then
    exit 0
fi
echo "shardkit: installing into $PWD/$venv (${extras:-core})" >&2
# --no-compile: pip would byte-compile every module of torch, transformers, lightning... (most
# never imported here); Python compiles what is imported on first use and caches it
# (in .venv/pycache when run by demo.sh or test.sh).
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
"${pip[@]}" "torch==2.13.0"
target=.
if [[ -n "$extras" ]]; then target=".[$extras]"; fi
# The rest goes through uv when it installs (pinned): it downloads in parallel, so the
# dev extras take about 40 s instead of pip's 3-4 minutes. uv reads no pip config and
# cannot see the local torch wheel, so it gets the installed torch as a constraint and
# keeps it. If uv cannot be had or fails, pip does the same install.
# editable_mode=compat puts the checkout itself on sys.path (a .pth entry), so
# a clone run from its parent folder imports the package, not the clone folder
# as an empty namespace package.
torch_version="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
if "${pip[@]}" "uv==0.13.9" 2>/dev/null \
    && "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" \
        --constraint <(echo "torch==$torch_version") -C editable_mode=compat -e "$target"; then
    :
else
    echo "shardkit: uv did not install; installing with pip" >&2
    "${pip[@]}" --config-settings editable_mode=compat -e "$target"
fi
# A dev install also satisfies a later core-only run: remember both. (An
# `if`, not `[[ ]] &&`: a last command with status 1 would fail the script.)
{
    echo "$want"
    if [[ -n "$extras" ]]; then echo "${want% *} core"; fi
} > "$stamp"
