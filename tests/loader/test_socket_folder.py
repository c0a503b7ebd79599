"""A temporary folder too long for the Unix socket DataLoader workers pass tensors through.

torch's workers send each tensor's file descriptor through a socket under the
temporary folder; past 107 bytes the bind fails in the worker's queue thread,
the batch is dropped and a plain DataLoader waits forever. shardkit's loaders
raise a LoaderError naming TMPDIR before they start a worker.
"""

from __future__ import annotations

import multiprocessing.process
import os
import tempfile

import pytest
import torch
from torch.utils.data import IterableDataset

import shardkit
from shardkit.errors import LoaderError
from shardkit.tempfiles import SOCKET_PATH_MAX, socket_folder_problem
from tests.helpers.processes import run_python


class Numbers(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([i]) for i in range(8))


@pytest.fixture
def long_tmpdir(tmp_path, monkeypatch):
    """TMPDIR as a fresh process sees it: a long folder, and no multiprocessing folder made yet."""
    folder = tmp_path / ("t" * (SOCKET_PATH_MAX - len(str(tmp_path))))
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    config = multiprocessing.process.current_process()._config
    if "tempdir" in config:
        monkeypatch.delitem(config, "tempdir")
    return folder


def test_a_long_temporary_folder_is_refused_before_any_worker_starts(long_tmpdir):
    loader = shardkit.MixedLoader(Numbers(), batch_size=4, num_workers=2)
    with pytest.raises(LoaderError, match=r"MixedLoader: the temporary folder .* is too long .* Set TMPDIR"):
        next(iter(loader))


def test_a_long_temporary_folder_is_refused_by_the_stateful_dataloader(long_tmpdir):
    loader = shardkit.StatefulDataLoader(Numbers(), batch_size=4, num_workers=2)
    with pytest.raises(LoaderError, match=r"StatefulDataLoader: the temporary folder .* would be \d+ bytes"):
        iter(loader)


def test_without_workers_or_with_file_system_sharing_a_long_folder_is_fine(long_tmpdir):
    assert [b.tolist() for b in shardkit.MixedLoader(Numbers(), batch_size=4)] == [
        [[0], [1], [2], [3]],
        [[4], [5], [6], [7]],
    ]
    assert socket_folder_problem("x", "file_system") is None
    assert socket_folder_problem("x", "file_descriptor") is not None


def test_a_folder_multiprocessing_already_made_is_the_one_measured(tmp_path, monkeypatch):
    """Forked workers inherit the parent's pymp folder: a short one made already makes any TMPDIR fine."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("t" * 200)))
    monkeypatch.setitem(multiprocessing.process.current_process()._config, "tempdir", "/tmp/pymp-abcdefgh")
    assert socket_folder_problem("x", "file_descriptor") is None


@pytest.mark.slow
def test_a_process_started_with_a_long_tmpdir_fails_at_once_instead_of_hanging(tmp_path):
    folder = tmp_path / ("t" * (SOCKET_PATH_MAX - len(str(tmp_path))))
    folder.mkdir()
    code = (
        "import torch, shardkit\n"
        "from torch.utils.data import IterableDataset\n"
        "class N(IterableDataset):\n"
        "    def __iter__(self): yield from (torch.tensor([i]) for i in range(8))\n"
        "print(sum(1 for _ in shardkit.MixedLoader(N(), batch_size=4, num_workers=2)))\n"
    )
    done = run_python("-c", code, check=False, timeout=120, env={**os.environ, "TMPDIR": str(folder)})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("shardkit.errors.LoaderError: MixedLoader: the temporary")


@pytest.mark.parametrize(("length", "refused"), [(75, False), (76, True)])
def test_the_limit_is_where_a_plain_dataloader_starts_to_hang(monkeypatch, length, refused):
    """Measured with a plain DataLoader of 2 workers: TMPDIR of 75 bytes works, 76 hangs."""
    monkeypatch.setattr(tempfile, "tempdir", "/" + "t" * (length - 1))
    config = multiprocessing.process.current_process()._config
    if "tempdir" in config:
        monkeypatch.delitem(config, "tempdir")
    assert (socket_folder_problem("x", "file_descriptor") is not None) == refused
