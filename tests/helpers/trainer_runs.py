"""The examples' trainer runs on 2 ranks, and what they record (``--record``).

Two ways to start a run's ranks. :func:`launch` runs the documented command
(``python script`` or ``torchrun --nproc_per_node=2 script``): a new
interpreter per rank and launcher, each importing torch and the trainer
again. :func:`launch_ranks` asks one :mod:`tests.scripts.rank_server`
(started once per test process, on first use) to fork the ranks from an
interpreter that imported the trainers already, with torchrun's environment:
the same script, ranks and gloo process group, without the seconds of
imports per process; the tests that launch many runs use it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tests.helpers.load import hang_bound
from tests.helpers.processes import REPO, free_port

SERVER = REPO / "tests" / "scripts" / "rank_server.py"


def launch(args: list[str], *, torchrun: bool, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    """``python [-m torch.distributed.run --nproc_per_node=2] *args`` from the repository, output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    env.pop("SHARDKIT_EXAMPLE_DATA", None)
    prefix = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={env['MASTER_PORT']}"]
    command = [sys.executable, *(prefix if torchrun else []), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=hang_bound(timeout), env=env, cwd=REPO)


class RankServer:
    """One ``rank_server.py`` process: :meth:`launch` runs a script on 2 ranks forked from it."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="shardkit-rank-server-")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("SHARDKIT_EXAMPLE_DATA", None)
        self.log = open(f"{self.folder}/server.stderr", "w")  # noqa: SIM115  (open while the server runs)
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=env, cwd=REPO, start_new_session=True,
        )  # fmt: skip
        self.runs = 0
        self.reply()  # {"ready": pid} once the imports are done

    def reply(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the rank server ended: {Path(self.log.name).read_text()[-3000:]}")
        return json.loads(line)

    def launch(
        self, args: list[str], timeout: float, ranks: int = 2, grace: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        assert self.process.stdin is not None
        self.runs += 1
        out = Path(self.folder) / f"run{self.runs}"
        out.mkdir()
        request = {"script": str(Path(args[0]).resolve()), "args": args[1:], "out": str(out), "timeout": timeout}
        request["ranks"] = ranks
        if grace is not None:
            request["grace"] = grace
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            codes = self.reply()["returncodes"]
        except BaseException:  # e.g. pytest-timeout: its reply would answer the next request
            self.process.send_signal(signal.SIGINT)  # the server ends the run's ranks, then itself
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
            _server.remove(self)
            raise
        stdout, stderr = (
            "".join((out / f"rank{r}.{name}").read_text() for r in range(len(codes))) for name in ("stdout", "stderr")
        )
        stderr += "".join(f"\nrank {r} {ended(code)}" for r, code in enumerate(codes) if code)
        return subprocess.CompletedProcess(args, next((c for c in codes if c), 0), stdout, stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)  # the runs' outputs, read already


def ended(code: int) -> str:
    """How a rank ended, as torchrun says it: ``exited with 3`` or ``ended by signal 9 (SIGKILL)``."""
    return f"ended by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with {code}"


_server: list[RankServer] = []


def launch_ranks(
    args: list[str], timeout: int = 180, ranks: int = 2, grace: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node=2 *args``, the ranks forked from the rank server (see above);
    ``grace``: seconds the other ranks get to end by themselves after one failed (the server's default).
    ``timeout`` only catches a hang: it is stretched by the machine's load (``tests/helpers/load.py``)."""
    if not _server:
        _server.append(RankServer())
        atexit.register(_server[0].close)
    return _server[0].launch(args, hang_bound(timeout), ranks, grace)


def write_example_data(example: Path, folder: Path, records: int) -> None:
    """The example's dataset of ``records`` records in ``folder``, for its runs' ``--data``."""
    done = launch_ranks([str(REPO / "tests" / "scripts" / "example_data.py"), str(example), str(folder), str(records)],
                        ranks=1)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def recorded_steps(folder: Path, rank: int) -> dict[int, dict]:
    """Each global step a rank trained, by step: ``{"step", "epoch", "ids"}`` (``rank{r}.steps.jsonl``)."""
    lines = (folder / f"rank{rank}.steps.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    by_step = {s["step"]: s for s in steps}
    assert len(by_step) == len(steps), f"rank {rank} recorded a step twice"
    return by_step


def recorded_reads(folder: Path) -> Counter[int]:
    """How often the pipelines of every rank and worker read (mapped) each id (``rank{r}.reads.{pid}``)."""
    return Counter(int(line) for path in folder.glob("rank*.reads.*") for line in path.read_text().split())
