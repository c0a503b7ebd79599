"""tests.helpers.once: a launch shared by every pytest-xdist worker runs once, its failure too."""

from __future__ import annotations

import threading
import uuid

import pytest

from tests.helpers.once import once


@pytest.fixture
def as_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")


def test_workers_asking_at_once_share_one_run_and_its_json_result(
    tmp_path_factory: pytest.TempPathFactory, as_xdist_worker: None
) -> None:
    runs: list[int] = []
    barrier = threading.Barrier(4)

    def produce() -> dict[str, list[int]]:
        runs.append(1)
        return {"ranks": [0, 1]}

    results: list[object] = []
    name = f"shared-{uuid.uuid4().hex}"  # the folder is the session's: a name of this run only

    def ask() -> None:
        barrier.wait()
        results.append(once(tmp_path_factory, name, produce))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runs == [1]
    assert results == [{"ranks": [0, 1]}] * 4


def test_a_failed_launch_fails_every_asker_with_its_message_and_is_not_run_again(
    tmp_path_factory: pytest.TempPathFactory, as_xdist_worker: None
) -> None:
    runs: list[int] = []

    def produce() -> None:
        runs.append(1)
        raise OSError("torchrun exited 1")

    name = f"broken-{uuid.uuid4().hex}"
    for _ in range(2):
        with pytest.raises(RuntimeError, match=rf"'{name}' failed .*OSError: torchrun exited 1"):
            once(tmp_path_factory, name, produce)
    assert runs == [1]


def test_without_xdist_it_is_a_plain_call(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    calls = iter(range(10))
    assert [once(tmp_path_factory, "plain", lambda: next(calls)) for _ in range(2)] == [0, 1]
