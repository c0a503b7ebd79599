"""Shared pytest fixtures."""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Property tests draw every example in the full suite and a third in the inner loop
    (``tests/helpers/examples.py``); set before any test module is imported.

    They are bounded by their example counts, never by wall time: no per-example deadline
    and no health check that times data generation, so a busy machine cannot fail them
    (Hypothesis's default 200 ms deadline is reached by a correct example at load 8 on 2 cores).
    """
    from hypothesis import HealthCheck, settings

    from tests.helpers import examples

    examples.FULL = examples.full_run(config.option.markexpr or "", os.environ.get("CI"))
    count = 100 if examples.FULL else examples.examples(100)  # tests that name no count: a third in the inner loop
    settings.register_profile(
        "shardkit", max_examples=count, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("shardkit")


@pytest.hookimpl(trylast=True)  # after deselection (-k, -m): only the tests that run are placed
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the long tests go first, spread over the workers (``tests/helpers/schedule.py``):
    every worker collects, and each reorders alike, so the collections stay identical."""
    from tests.helpers.schedule import order

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    items[:] = order(items, [item.nodeid for item in items], workers)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout's per-test bound (pyproject.toml) only catches hangs: stretched by the machine's
    load when the test starts (``tests/helpers/load.py``), so a slow machine fails no test."""
    import pytest_timeout

    from tests.helpers.load import hang_bound

    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=hang_bound(settings.timeout)))


@dataclass(frozen=True)
class S3Server:
    """A local S3-compatible server (moto in server mode) on 127.0.0.1."""

    endpoint_url: str

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url},
            "use_listings_cache": False,
            # fsspec's instance cache is kept: a new S3FileSystem per open builds a new
            # aiobotocore session and client (about 70 ms each, 10x the reads of a small
            # test). Listings stay uncached; forked workers get their own instances.
        }

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name and return ``s3://<name>``."""
        import fsspec

        name = f"test-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3", **self.storage_options()).mkdir(name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free port of 127.0.0.1 for the whole session."""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    credentials = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in credentials}
    os.environ.update(credentials)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def counts_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test gets its own, empty counts cache directory (never the user's ~/.cache)."""
    path = str(tmp_path_factory.mktemp("shardkit-cache"))
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", path)
    return path


@pytest.fixture(scope="session")
def plain_import(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What one new interpreter saw after ``import shardkit`` (tests.helpers.processes.plain_import),
    shared by the tests that each assert on one part of it (and by every xdist worker)."""
    from tests.helpers.once import once
    from tests.helpers.processes import plain_import

    return once(tmp_path_factory, "plain-import", plain_import)


_LIVE_WORKER_ITERATORS: weakref.WeakSet = weakref.WeakSet()


def _track_worker_iterators(cls: type) -> None:
    """Remember every instance of a DataLoader iterator class with worker processes."""
    init = cls.__init__

    def tracked_init(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _LIVE_WORKER_ITERATORS.add(self)

    cls.__init__ = tracked_init


@pytest.fixture(scope="session", autouse=True)
def _worker_iterators_tracked() -> None:
    from torch.utils.data import dataloader

    _track_worker_iterators(dataloader._MultiProcessingDataLoaderIter)
    try:
        from torchdata.stateful_dataloader import stateful_dataloader
    except ImportError:
        return
    _track_worker_iterators(stateful_dataloader._StatefulMultiProcessingDataLoaderIter)


@pytest.fixture(autouse=True)
def _worker_iterators_shut_down(_worker_iterators_tracked: None) -> Iterator[None]:
    """End the workers of DataLoader iterators a test left behind, when the test ends.

    An error re-raised from a worker holds its iterator in a reference cycle (torch's
    ExceptionWrapper.reraise keeps the exception in its own frame), so the iterator waits for
    the garbage collector. Shut down from there, it waits 5 s for every worker and then
    terminates it (measured: a gc.collect() after a 2-worker error took 11.8 s), in whatever
    test the collection happens to run; most likely the collector has already finalized the
    iterator's queues, so the workers never get their stop signal. Shut down here, the workers
    stop at once (0.8 s for that collection). The test itself sees nothing of this: it has ended."""
    yield
    for iterator in list(_LIVE_WORKER_ITERATORS):
        iterator._shutdown_workers()  # idempotent: a finished or deleted iterator returns at once
