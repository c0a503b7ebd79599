"""Small things a new user meets in the first hour: warnings, wording, progress bars, examples."""

from __future__ import annotations

import gc
import warnings

import shardkit
from shardkit.stats import SharedStats
from tests.helpers.load import hang_bound


def resource_warnings(make) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = make()
        del made
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def test_shared_stats_close_their_lock_file_without_a_resource_warning():
    assert resource_warnings(lambda: SharedStats(3)) == []


def test_a_dataset_leaves_no_unclosed_file_behind(tmp_path):
    with shardkit.TFRecordWriter(str(tmp_path / "a.tfrecord")) as w:
        w.write(shardkit.encode_example({"x": 1}))
    url = str(tmp_path / "a.tfrecord")
    assert resource_warnings(lambda: list(shardkit.TFRecordDataset(url))) == []
    assert resource_warnings(lambda: shardkit.TFRecordDataset(url)) == []


def run_in_a_terminal(*argv: str) -> str:
    """``shardkit *argv`` (``main(argv)``, in this process) with its stderr on a pseudo-terminal, where
    progress bars show; the terminal's output. The command must succeed."""
    from shardkit.cli import main

    return terminal_output(lambda: main(list(argv)) == 0)


def terminal_output(run) -> str:
    """Call ``run()`` (it must return True) with ``sys.stderr`` on a pseudo-terminal; the terminal's output.

    In this process rather than a new one: a fresh interpreter costs seconds of imports. A thread drains
    the terminal meanwhile, so a long output cannot fill it and block the writer, and it reads until the
    terminal is quiet before the terminal is closed: closing it first can drop the last bytes written."""
    import contextlib
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    import threading

    main_fd, terminal = pty.openpty()
    # A new pty is 0 columns wide; tqdm cuts its line to the width, and the bar names a tmp_path (longer under
    # pytest-xdist): 400 columns keep the throughput on the line.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 400, 0, 0))
    chunks: list[bytes] = []
    finished = threading.Event()

    def drain() -> None:
        while select.select([main_fd], [], [], 0.2)[0] or not finished.is_set():
            if select.select([main_fd], [], [], 0)[0]:
                chunks.append(os.read(main_fd, 65536))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stderr = os.fdopen(terminal, "w", buffering=1)
    try:
        with contextlib.redirect_stderr(stderr):
            assert run()
        stderr.flush()
        finished.set()
        reader.join(timeout=hang_bound(60))
    finally:
        finished.set()
        stderr.close()
        os.close(main_fd)
    return b"".join(chunks).decode(errors="replace")


def test_long_commands_leave_a_progress_bar_with_throughput_on_a_terminal(tmp_path):
    url = str(tmp_path / "a.tfrecord")
    with shardkit.TFRecordWriter(url) as w:
        for n in range(100):
            w.write(shardkit.encode_example({"x": n}))
    for argv in (["verify", url], ["index", url]):
        shown = run_in_a_terminal(*argv)
        assert "100%" in shown and "B/s" in shown, (argv, shown)
    shown = run_in_a_terminal("convert", url, str(tmp_path / "o-%02d.jsonl"), "--format", "jsonl")
    assert "100 records" in shown and "records/s" in shown, shown


def test_counting_records_leaves_a_progress_bar_with_throughput_on_a_terminal(tmp_path):
    urls = []
    for k in range(3):
        urls.append(str(tmp_path / f"a-{k}.tfrecord"))
        with shardkit.TFRecordWriter(urls[-1]) as w:
            for n in range(10):
                w.write(shardkit.encode_example({"x": n}))
    # the counts cache is this test's own, empty one (conftest's counts_cache_dir): every shard is counted
    shown = terminal_output(lambda: shardkit.TFRecordDataset(urls, decode="raw").count_records() is not None)
    assert "counting records" in shown and "3/3" in shown and "shards/s" in shown, shown


def test_shardkit_state_is_reachable_after_a_plain_import_shardkit(plain_import):
    """The docs write shardkit.state.gather(...) after `import shardkit`; it must not
    depend on another module having imported shardkit.state first (a new interpreter)."""
    assert plain_import["state"] == ["gather", "StateError"]
