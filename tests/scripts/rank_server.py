"""Starts the ranks of many trainer runs from one interpreter that imported the trainers once.

    python tests/scripts/rank_server.py      # then one JSON request per line on stdin

A trainer run's start-up is mostly ``import torch, lightning, accelerate,
transformers`` in every rank and in the launcher (torchrun, or Lightning
re-running the script for rank 1): some 10 s on a quiet 2-core machine and far
more on a loaded one, paid 3 times per run. This server pays it once: it
imports them, then for each request forks one process per rank, each with the
environment torchrun gives its ranks (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...), and runs the
script as ``__main__`` in it, as torchrun would. The parent only imports:
it runs no torch operation and starts no thread, so a forked rank is as
fresh as a new interpreter (no OpenMP pool, no process group, no state of
an earlier run: each run's ranks are new processes that end with it). The
imported objects are frozen out of the garbage collector (``gc.freeze``) and a
rank ends as multiprocessing's forked processes do (atexit handlers, then
``os._exit``), so no rank copies the server's heap page by page to collect it.

A request: ``{"script", "args", "ranks", "out", "timeout", "grace"}`` (``grace``: seconds,
:data:`GRACE` if left out). Rank ``r`` writes its stdout and stderr to ``out/rank{r}.stdout``
and ``.stderr``. As under torchrun, when one rank fails the others are ended (after a grace
period in which a rank that is about to end by itself can); a run past its
timeout gets SIGABRT (each rank prints its Python stacks) and then SIGKILL, as
does a run the client gives up on (it sends SIGINT; the server then ends).
The reply, one JSON line: ``{"returncodes": [...]}`` (``-N``: ended by signal N).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

import accelerate  # noqa: F401  (imported once, here: what each rank would otherwise import again)
import lightning  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import Trainer  # noqa: F401

import shardkit  # noqa: F401
from tests.helpers.processes import exit_as_a_script, free_port, torchrun_environment

#: Seconds the other ranks get to end by themselves after one rank failed (torchrun ends them at once;
#: a rank that ends itself on purpose, as the killed runs do, may be a moment ahead of the others).
GRACE = 5.0
POLL = 0.05


def rank_environment(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What ``torchrun --nproc_per_node=ranks`` sets for one of its ranks, and faulthandler on."""
    environment = torchrun_environment(rank, ranks, port)
    return {**environment, "TORCHELASTIC_RUN_ID": f"rank-server-{port}", "PYTHONFAULTHANDLER": "1"}


def run_rank(script: str, args: list[str], environment: dict[str, str], out: str, rank: int) -> None:
    """In the forked child: become rank ``rank``, run ``script`` as ``__main__``, end; never returns."""
    os.setpgid(0, 0)  # its own process group: its DataLoader workers end with it on a timeout
    for stream, name in ((1, "stdout"), (2, "stderr")):
        fd = os.open(f"{out}/rank{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, stream)
        os.close(fd)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the server's requests are not the rank's input)
    os.environ.update(environment)
    faulthandler.enable()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python script`: its folder first on the path
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
        if not isinstance(ended.code, int | None):
            print(ended.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (a rank's error is its output and exit status, as in a process)
        traceback.print_exc()
        code = 1
    exit_as_a_script(code)


def wait_all(pids: list[int], timeout: float, grace: float = GRACE) -> list[int]:
    """The ranks' exit codes (``-N`` for signal N); ends the others after a failure or at the timeout."""
    codes: dict[int, int] = {}
    deadline, failed_at = time.monotonic() + timeout, None
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    if codes[pid] != 0 and failed_at is None:
                        failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            end([pid for pid in pids if pid not in codes], abort=now > deadline)
            deadline = failed_at = float("inf")
        time.sleep(POLL)
    return [codes[pid] for pid in pids]


def end(pids: list[int], abort: bool) -> None:
    """SIGABRT (the fault handler prints the Python stacks) when ``abort``, then SIGKILL, to each group."""
    for sig in (signal.SIGABRT, signal.SIGKILL) if abort else (signal.SIGKILL,):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGABRT:
            time.sleep(3)


def serve(request: dict) -> dict:
    ranks, port = request.get("ranks", 2), free_port()
    pids = []
    for rank in range(ranks):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the rank; it never returns here
            run_rank(request["script"], request["args"], rank_environment(rank, ranks, port), request["out"], rank)
        pids.append(pid)
    try:
        codes = wait_all(pids, request.get("timeout", 300), request.get("grace", GRACE))
    except KeyboardInterrupt:  # the test gave up on this run (its own timeout): no rank outlives it
        end(pids, abort=True)
        raise
    end(pids, abort=False)  # DataLoader workers a rank left (os._exit skipped their shutdown; a kill, too)
    return {"returncodes": codes}


def main() -> None:
    assert threading.active_count() == 1, "a thread in the server would be copied into no rank: fork is unsafe"
    gc.freeze()  # the imported modules' objects: no rank's collection copies their pages
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
