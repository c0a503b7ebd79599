"""Runs several ``benchmarks/*.py --quick`` one after the other in this one interpreter, for
tests/test_benchmarks_smoke.py.

Each script runs as its own ``python benchmarks/NAME.py --quick`` would (``runpy`` with
``__name__ == "__main__"``, ``sys.argv`` set), but torch, shardkit, datasets and transformers
are imported once for all of them instead of once per script: on 2 shared cores that import is
5-20 s a process. Each script's output is framed by two marker lines, the second with how it
ended (exit status 0, the status of its ``SystemExit``, or 1 and its traceback on stderr), so that
one test per script can assert on its own part (stderr is framed alike); this script always exits 0.

    python tests/scripts/benchmarks_quick.py compare.py:--dir=/tmp/content shuffle.py formats.py
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
BEGIN, END = "=== begin ", "=== end "


def run(script: str, extra: list[str]) -> int:
    """``python benchmarks/<script> --quick *extra`` in this process; its exit status."""
    path = os.path.join(BENCHMARKS, script)
    saved_argv, saved_environ = sys.argv, dict(os.environ)
    sys.argv = [path, "--quick", *extra]
    sys.path.insert(0, BENCHMARKS)  # as `python benchmarks/NAME.py` has it (a script may take it off)
    saved_path = list(sys.path)
    try:
        runpy.run_path(path, run_name="__main__")
        return 0
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:  # what one script sets (HF_HOME, a server's url) does not leak into the next
        sys.path[:] = [p for p in saved_path if p != BENCHMARKS]
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_environ)


def main() -> None:
    for spec in sys.argv[1:]:
        script, *extra = spec.split(":")
        for stream in (sys.stdout, sys.stderr):
            print(f"{BEGIN}{script}", file=stream, flush=True)
        began = time.perf_counter()
        status = run(script, [arg for part in extra for arg in part.split(",") if arg])
        for stream in (sys.stdout, sys.stderr):
            print(f"\n{END}{script} exit {status}", file=stream, flush=True)
        print(
            f"{script}: {time.perf_counter() - began:.1f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True
        )


if __name__ == "__main__":
    main()
