"""What a process creates it removes: DataLoader workers leave no temporary files or ``pymp-*`` dirs after an
epoch or a persistent loader's end, and workers whose main process was SIGKILLed stop within a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.load import hang_bound

LEFTOVERS = ("shardkit-", "pymp-")

_EPOCHS = """
import gc, os, sys, tempfile, traceback
import shardkit
import torch.utils.data._utils
from torch.utils.data import DataLoader
from tests.io.test_remote_reads import write_shard

def leftovers():
    return sorted(name for name in os.listdir(tempfile.gettempdir()) if name.startswith(("shardkit-", "pymp-")))

def main():
    data = sys.argv[1]
    urls = [f"{data}/s{i}.tfrecord" for i in range(4)]
    for i, url in enumerate(urls):
        write_shard(url, count=20, seed=i)
    dataset = shardkit.TFRecordDataset(urls, shuffle=True, seed=0, decode="raw", index=False)
    if sys.argv[2] == "dataloader":  # not persistent: each epoch's workers count in workers and exit
        for epoch in range(3):
            dataset.set_epoch(epoch)
            assert sum(1 for _ in DataLoader(dataset, batch_size=None, num_workers=2)) == 80
            print("epoch", epoch, leftovers(), flush=True)
    elif sys.argv[2] == "error":  # each epoch ends with a worker's error
        from tests.helpers.shards import record_offsets
        from tests.sources.test_faults_reading import flip_data_byte

        flip_data_byte(urls[0], record_offsets(urls[0]), [5])
        # How long DataLoader's shutdown waits for each worker before it terminates it: 5 s. The
        # collector's shutdown of epoch 0 below always waits it out (its workers never get their exit
        # message) and then terminates them: the same ending after 0.5 s.
        torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL = 0.5
        for epoch in range(3):
            dataset.set_epoch(epoch)
            try:
                list(DataLoader(dataset, batch_size=None, num_workers=2))
            except shardkit.CorruptRecordError as error:
                if epoch:  # the traceback's frames let go of the iterator: it shuts its workers down at once
                    traceback.clear_frames(error.__traceback__)
            # Epoch 0: the traceback held the iterator in a cycle; shut down by the collector here,
            # it waits MP_STATUS_CHECK_INTERVAL for each worker and then terminates it (SIGTERM).
            # Both endings are checked.
            gc.collect()
            print("epoch", epoch, leftovers(), flush=True)
    else:
        loader = shardkit.MixedLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(len(batch) for batch in loader) == 80
        del loader
        gc.collect()
        print("deleted", leftovers(), flush=True)

if __name__ == "__main__":
    main()
"""


def run_in_fresh_tmpdir(tmp_path, script: str, *args: str) -> tuple[list[str], list[str]]:
    """Run ``script`` with TMPDIR a new empty dir; its output lines, and what is left in TMPDIR after it ends.

    The dir is a short one in the system's temporary folder, not under ``tmp_path``: multiprocessing binds
    Unix sockets in TMPDIR (``pymp-*/listener-*``, to pass descriptors between processes), and a socket path
    is limited to 107 bytes. Under pytest-xdist, tmp_path gains a ``popen-gwN`` level and a persistent
    MixedLoader then waited forever for a worker that could not hand its tensors over."""
    import shutil
    import tempfile

    tmpdir, data = Path(tempfile.mkdtemp(prefix="sk-")), tmp_path / "data"
    data.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.getcwd()}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(data), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=hang_bound(240),
        )
        assert done.returncode == 0, done.stderr
        left = sorted(name for name in os.listdir(tmpdir) if name.startswith(LEFTOVERS))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return done.stdout.splitlines(), left


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["dataloader", "error"])
def test_epochs_that_count_in_their_workers_leave_no_temporary_files(tmp_path, ending) -> None:
    lines, left = run_in_fresh_tmpdir(tmp_path, _EPOCHS, ending)
    during = [line for line in lines if line.startswith("epoch")]
    assert len(during) == 3
    counts = [line.count("shardkit-") for line in during]
    assert counts[0] == counts[2] <= 1, during  # nothing added epoch after epoch (the main process's list, at most)
    assert left == []


@pytest.mark.slow
def test_a_deleted_persistent_mixed_loader_leaves_no_temporary_files_or_dirs(tmp_path) -> None:
    lines, left = run_in_fresh_tmpdir(tmp_path, _EPOCHS, "mixed")
    (deleted,) = [line for line in lines if line.startswith("deleted")]
    shown = deleted.split(" ", 1)[1]
    assert "pymp-" not in shown and shown.count("shardkit-") <= 1, deleted  # the dataset's own shard list, at most
    assert left == []


_ORPHANS = """
import os, sys, time
import shardkit
from torch.utils.data import DataLoader

def slow_read(url, start, stop):
    with open(os.path.join(sys.argv[1], str(os.getpid())), "w"):
        pass
    for i in range(start, 10**6 if stop is None else stop):
        time.sleep(0.05)  # a batch of 200 takes 10 s: an orphan would run on for that long
        yield i

def main():
    shards = shardkit.ShardList([f"mem/s{i}" for i in range(4)], [100_000] * 4)
    dataset = shardkit.ShardedDataset(shards, slow_read)
    context = sys.argv[3]
    if sys.argv[2] == "dataloader":
        loader = DataLoader(dataset, batch_size=200, num_workers=2, multiprocessing_context=context)
    else:
        loader = shardkit.MixedLoader(
            dataset, batch_size=200, num_workers=2, persistent_workers=True, multiprocessing_context=context
        )
    print("started", flush=True)
    for _ in loader:
        pass

if __name__ == "__main__":
    main()
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie nobody reaps has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("loader", "context"), [("dataloader", "fork"), ("mixed", "fork"), ("mixed", "forkserver")])
def test_workers_stop_within_a_second_or_two_after_their_main_process_is_killed(tmp_path, loader, context) -> None:
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    script = tmp_path / "orphans.py"  # a file: forkserver workers import the read function from it
    script.write_text(_ORPHANS)
    main = subprocess.Popen(
        [sys.executable, str(script), str(pids_dir), loader, context], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + hang_bound(120)
        while len(os.listdir(pids_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [int(name) for name in os.listdir(pids_dir)]
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        time.sleep(1.0)  # the workers are well into a batch
        assert all(alive(pid) for pid in workers)  # the watchdog leaves workers of a live main process alone
        main.send_signal(signal.SIGKILL)
        main.wait(timeout=10)
        killed = time.monotonic()
        while any(alive(pid) for pid in workers) and time.monotonic() - killed < hang_bound(5):
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers), "orphaned workers still running 5 s after"
        assert time.monotonic() - killed < hang_bound(2.0)
    finally:
        main.kill()
        for name in os.listdir(pids_dir):
            if alive(int(name)):
                os.kill(int(name), signal.SIGKILL)


_FILLING = """
import sys
import shardkit
from torch.utils.data import DataLoader

def main():
    server, cache_dir = sys.argv[1], sys.argv[2]
    shards = shardkit.ShardList([f"{server}/s{i}.tfrecord" for i in range(2)], [300, 300])
    dataset = shardkit.TFRecordDataset(shards, decode="raw", index=False, cache_dir=cache_dir, readahead_bytes=0)
    for _ in DataLoader(dataset, batch_size=None, num_workers=2):
        pass

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_orphaned_while_filling_the_cache_leave_no_temporary_file_or_lock(tmp_path) -> None:
    from tests.helpers.fault_server import FaultServer
    from tests.io.test_remote_reads import write_shard

    (tmp_path / "data").mkdir()
    for i in range(2):
        write_shard(str(tmp_path / "data" / f"s{i}.tfrecord"), seed=i)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    script = tmp_path / "filling.py"
    script.write_text(_FILLING)
    with FaultServer(str(tmp_path / "data")) as server:
        server.latency = 3.0  # each fill waits seconds for its bytes: the main process dies meanwhile
        main = subprocess.Popen([sys.executable, str(script), server.url, str(cache)], env=env)
        try:
            deadline = time.monotonic() + hang_bound(60)
            # Both workers filling (one shard each), so that every file left behind is a watched filler's:
            # with one seen, the other could start its fill after the main process was killed (seen under load).
            while time.monotonic() < deadline and sum(".tmp." in name for name in _names(cache)) < 2:
                time.sleep(0.05)
            locks = [cache / name for name in _names(cache) if name.endswith(".lock")]
            fillers = [int(lock.read_text()) for lock in locks]
            assert len(fillers) == 2 and all(alive(pid) for pid in fillers)
            main.send_signal(signal.SIGKILL)
            main.wait(timeout=10)
            killed = time.monotonic()  # poll: the fillers end within a second or two of their main process
            while any(alive(pid) for pid in fillers) and time.monotonic() - killed < hang_bound(2.0):
                time.sleep(0.05)
            assert not any(alive(pid) for pid in fillers), "orphaned fillers still running 2 s after"
            assert [name for name in _names(cache) if ".tmp." in name or name.endswith(".lock")] == []
        finally:
            main.kill()


def _names(directory) -> list[str]:  # type: ignore[no-untyped-def]
    return os.listdir(directory) if os.path.isdir(directory) else []


_LEFT_MID_EPOCH = """
import multiprocessing, sys
import shardkit
from torch.utils.data import DataLoader
from tests.io.test_remote_reads import write_shard

def rank(urls, kind):
    dataset = shardkit.TFRecordDataset(urls, decode="raw", index=False)
    if kind == "dataloader":
        loader = DataLoader(dataset, batch_size=4, num_workers=2)
    else:
        loader = shardkit.MixedLoader(dataset, batch_size=4, num_workers=2)
    batches = iter(loader)
    next(batches)
    globals()["kept"] = batches  # alive until the process exits, as a rank's loader left mid-epoch is

def main():
    urls = [f"{sys.argv[1]}/s{i}.tfrecord" for i in range(2)]
    for i, url in enumerate(urls):
        write_shard(url, count=200, seed=i)
    codes = []
    for _ in range(3):
        process = multiprocessing.get_context("fork").Process(target=rank, args=(urls, sys.argv[2]))
        process.start()
        process.join(120)
        codes.append(process.exitcode)
    print("exit codes", codes, flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dataloader", "mixed"])
def test_a_process_that_exits_with_its_loader_mid_epoch_exits_cleanly(tmp_path, kind):
    # multiprocessing SIGTERMs the still-running workers at exit; a worker that dies of that signal after
    # cleaning up is seen by DataLoader's SIGCHLD handler in the exiting process, which then fails.
    lines, _ = run_in_fresh_tmpdir(tmp_path, _LEFT_MID_EPOCH, kind)
    assert lines == ["exit codes [0, 0, 0]"]
