"""Processes for tests: Python subprocesses, gloo ranks, free ports, the repository's paths.

Module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

import atexit
import datetime
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers.load import hang_bound

REPO = Path(__file__).resolve().parents[2]


EXAMPLES = REPO / "examples"


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(*args: str, timeout: float = 300, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python *args`` in a new process, its output captured as text; with ``check``, it must exit 0
    (the end of its stderr is the failure message).

    The timeout bounds any hang: stretched by the machine's load when the process starts
    (``tests/helpers/load.py``), so a busy machine fails no test. The process runs in a session of
    its own with Python's fault handler on, so at the timeout every process it started (ranks,
    DataLoader workers) is sent SIGABRT, which prints each one's Python stacks, and then SIGKILL:
    the failure shows where each process was stuck, and none is left running to load the machine
    for the tests after it.
    """
    timeout = hang_bound(timeout)
    env = {**(kwargs.pop("env", None) or os.environ), "PYTHONFAULTHANDLER": "1"}
    _no_core_files()
    command = [sys.executable, *args]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, **kwargs
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = _stacks_then_kill(process)
            raise AssertionError(
                f"{' '.join(args)[:300]} did not end within {timeout:g} s; the stacks of its processes:\n{stacks}"
            ) from None
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


#: Seconds between SIGABRT (each process prints its stacks) and SIGKILL for a process that timed out.
DUMP_SECONDS = 3.0


def _stacks_then_kill(process: subprocess.Popen) -> str:
    """SIGABRT to the process's session (each Python process prints its stacks), then SIGKILL; the stderr."""
    for sig in (signal.SIGABRT, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGABRT:
            time.sleep(DUMP_SECONDS)
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process that left the session still holds the pipe
        return "(no output: a process outside the session still holds the pipe)"
    return stderr[-30000:]


def _no_core_files() -> None:
    """SIGABRT must not leave a core file in the working directory (inherited by every child)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


# What a new interpreter sees after a plain `import shardkit`, in the order a user meets it: one
# interpreter start (seconds of CPU: torch) answers several tests, each asserting on its own key.
_PLAIN_IMPORT = """
import json, sys
import shardkit
seen = {"state": [shardkit.state.gather.__name__, shardkit.state.StateError.__name__]}
shardkit.MixedLoader
seen["transformers imported"] = "transformers" in sys.modules
keep = shardkit.ShardList(["/a", "/b"])  # referenced until exit: its file goes at exit, not when collected
seen["backing file"] = keep.backing_file
print(json.dumps(seen), flush=True)
"""


def plain_import() -> dict[str, Any]:
    """Run ``import shardkit`` in a new interpreter (from the repository's root) and report what it saw:
    ``state`` (names reached through ``shardkit.state``), ``transformers imported`` (after touching
    ``shardkit.MixedLoader``), ``backing file`` (a live ShardList's, as the interpreter exited)."""
    done = run_python("-c", _PLAIN_IMPORT, timeout=120, cwd=REPO)
    return last_json_line(done.stdout)


def last_json_line(stdout: str) -> Any:
    """The JSON a check script prints as its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


def gloo_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    start_method: str = "spawn",
    collective_timeout: float | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in a gloo
    process group over localhost (destroyed when ``fn`` returns or raises); waits for all,
    and raises if one fails.

    The ranks meet through a file store in a fresh folder, not a TCP port picked in
    advance: a port found free can be taken by another process before rank 0 binds it.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="shardkit-gloo-") as folder:
        setup = (fn, world_size, os.path.join(folder, "store"), collective_timeout, args)
        mp.start_processes(_gloo_rank, args=setup, nprocs=world_size, join=True, start_method=start_method)


def _gloo_rank(
    rank: int, fn: Callable[..., None], world_size: int, store: str, timeout: float | None, args: tuple
) -> None:
    import torch.distributed as dist

    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, **options)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def end_loader_workers() -> int:
    """Shut down, now, the worker processes of every DataLoader iterator this process still holds;
    returns how many iterators had some. Call it between runs whose loaders are done with.

    A loader left mid-epoch (a run stopped early, a rank that stopped under ``at_end="stop"``, a
    worker's error kept in a traceback) sits in reference cycles, so only the cyclic GC frees it,
    at whatever moment it next runs. The GC finalizes the iterator's queues before the iterator:
    its ``None`` never reaches the workers, and DataLoader waits 5 s per worker before it
    terminates them (see ``shardkit/loader/mixer.py``, ``_stop_workers``). Shut down here, while
    the queues live, the workers exit at once.
    """
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    ended = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): that would ask every object its __class__ (torch's lazy modules warn)
        if type(obj) is _MultiProcessingDataLoaderIter and not obj._shutdown:
            if any(worker._parent_pid == os.getpid() for worker in obj._workers):  # not one a fork inherited
                obj._shutdown_workers()
                ended += 1
    gc.collect()
    return ended


def torchrun_environment(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What ``torchrun --standalone --nproc-per-node=ranks`` sets for one of its ranks."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "ROLE_WORLD_SIZE": str(ranks),
        "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": f"forked-{port}", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
    }  # fmt: skip


def fork_ranks(fn: Callable[[], None], ranks: int, environment: dict[str, str] | None = None) -> list[int]:
    """Run ``fn()`` in ``ranks`` processes forked from this one, each with torchrun's environment for its
    rank (plus ``environment``), as torchrun would run a script's ``main``; their exit codes (``-N``:
    signal N). For a check script that imported torch once and then runs several worlds one after
    another (tests/scripts/elastic_check.py): a torchrun start costs a launcher and a Python per rank
    importing torch, seconds each. The caller must have run no torch operation and started no thread
    (a forked rank must be as fresh as a new interpreter). When a rank fails, the others are killed
    (they would wait on it in a collective); the caller's own bound (:func:`run_python`'s timeout,
    which ends the whole session) bounds a hang."""
    assert threading.active_count() == 1, "a thread of this process would be copied into no rank: fork is unsafe"
    port, pids = free_port(), []
    for rank in range(ranks):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            code = 0
            try:
                os.environ.update({**torchrun_environment(rank, ranks, port), **(environment or {})})
                fn()
            except BaseException:  # noqa: BLE001  (a rank's error is its stderr and exit status)
                traceback.print_exc()
                code = 1
            exit_as_a_script(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        pid, status = os.wait()
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:
            for other in set(pids) - set(codes):
                os.kill(other, signal.SIGKILL)
    return [codes[pid] for pid in pids]


def exit_as_a_script(code: int) -> None:
    """End a forked child as ``python script`` ends, as multiprocessing's forked processes do: join the
    threads that are not daemons, run the atexit handlers (shutting down DataLoader workers, process
    groups, ...), flush. Then ``os._exit``: the rest of the interpreter's finalization would only free
    the heap, and in a child forked from an interpreter that imported torch (and Lightning,
    transformers) that takes seconds (each object's page is copied on write)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
