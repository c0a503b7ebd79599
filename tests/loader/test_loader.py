"""MixedLoader: per-batch worker shares, exactly-once coverage, tails, determinism."""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from shardkit import MixedLoader, wrap
from shardkit.errors import ShardkitError
from shardkit.loader.mixed import LoaderError, _accelerator_available
from shardkit.loader.mixer import Mixer as _Mixer

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def make_sample(worker: int, index: int) -> dict[str, Any]:
    """A sample holding every kind default_collate handles, nested."""
    return {
        "worker": worker,
        "index": index,
        "name": f"{worker}:{index}",
        "array": np.array([worker, index], dtype=np.int64),
        "pair": (float(index) / 2, f"w{worker}".encode()),
        "image": torch.full((2, 3), index, dtype=torch.uint8),
    }


class Tagged(IterableDataset):
    """Worker ``w`` yields ``counts[w]`` samples tagged with ``get_worker_info().id``;
    in the main process it yields ``counts[0]`` samples as worker 0."""

    def __init__(self, counts: list[int], *, sized: bool = False, slow_worker: int = -1) -> None:
        self.counts = counts
        self.sized = sized
        self.slow_worker = slow_worker
        self.epochs: list[int] = []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for index in range(self.counts[worker]):
            if worker == self.slow_worker:
                time.sleep(0.002)
            yield make_sample(worker, index)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return sum(self.counts)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Unsized(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def ids(batch: dict[str, Any]) -> list[tuple[int, int]]:
    return list(zip(batch["worker"].tolist(), batch["index"].tolist(), strict=True))


def check_batch_is_collated(batch: dict[str, Any]) -> None:
    """The assembled batch equals default_collate of its samples, in order."""
    expected = default_collate([make_sample(w, i) for w, i in ids(batch)])
    assert batch["name"] == expected["name"]
    assert batch["pair"][1] == expected["pair"][1]
    for got, want in (
        (batch["array"], expected["array"]),
        (batch["pair"][0], expected["pair"][0]),
        (batch["image"], expected["image"]),
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


def check_shares(batches: list[list[tuple[int, int]]], counts: list[int], batch_size: int) -> None:
    """Every batch but the last is full; each worker that still has data gives
    floor or ceil of what the workers that do not run dry share, in one block,
    in stream order; a worker running dry gives all it has left."""
    remaining = dict(enumerate(counts))
    for number, batch in enumerate(batches):
        if number < len(batches) - 1:
            assert len(batch) == batch_size
        shares = Counter(w for w, _ in batch)
        active = [w for w, left in remaining.items() if left]
        assert set(shares) <= set(active)
        drained = [w for w in active if shares[w] == remaining[w]]
        rest = [w for w in active if w not in drained]
        if rest:
            fair = (len(batch) - sum(shares[w] for w in drained)) / len(rest)
            assert all(shares[w] in (math.floor(fair), math.ceil(fair)) for w in rest), (
                number,
                shares,
                remaining,
            )
            assert all(shares[w] <= math.ceil(fair) for w in drained)
        blocks = [w for position, (w, _) in enumerate(batch) if position == 0 or batch[position - 1][0] != w]
        assert len(blocks) == len(set(blocks)), f"worker blocks split in batch {number}"
        for w, share in shares.items():
            start = counts[w] - remaining[w]
            assert [i for v, i in batch if v == w] == list(range(start, start + share))
            remaining[w] -= share


def run(loader: MixedLoader) -> list[list[tuple[int, int]]]:
    batches = []
    for batch in loader:
        check_batch_is_collated(batch)
        batches.append(ids(batch))
    return batches


@pytest.mark.parametrize(
    ("counts", "batch_size", "micro"),
    [
        ([25, 25], 7, None),
        ([40, 3, 17], 10, None),
        ([0, 9, 30, 1], 6, None),
        ([13], 5, None),
        ([5, 5, 5], 2, None),
        ([100, 7], 9, 4),
        ([11, 60, 2], 8, 3),
    ],
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_shares_and_exactly_once(counts: list[int], batch_size: int, micro: int | None, drop_last: bool) -> None:
    loader = MixedLoader(
        Tagged(counts),
        batch_size,
        num_workers=len(counts),
        drop_last=drop_last,
        micro_batch_size=micro,
        multiprocessing_context="fork",
    )
    batches = run(loader)
    total = sum(counts)
    expected_batches = total // batch_size if drop_last else math.ceil(total / batch_size)
    assert len(batches) == expected_batches
    check_shares(batches, counts, batch_size)
    seen = [sample for batch in batches for sample in batch]
    assert len(seen) == len(set(seen))
    everything = {(w, i) for w, n in enumerate(counts) for i in range(n)}
    if drop_last:
        assert set(seen) <= everything and len(seen) == total - total % batch_size
    else:
        assert set(seen) == everything


@pytest.mark.slow
def test_spawn_workers() -> None:
    counts = [12, 5]
    loader = MixedLoader(Tagged(counts), 4, num_workers=2, multiprocessing_context="spawn")
    batches = run(loader)
    check_shares(batches, counts, 4)
    assert sorted(s for b in batches for s in b) == [(w, i) for w, n in enumerate(counts) for i in range(n)]


def test_same_seed_same_batches_whatever_the_timing() -> None:
    counts = [30, 17, 24]
    first = run(MixedLoader(Tagged(counts), 8, num_workers=3, seed=7))
    slow = run(MixedLoader(Tagged(counts, slow_worker=0), 8, num_workers=3, seed=7))
    assert first == slow
    other_seed = run(MixedLoader(Tagged(counts), 8, num_workers=3, seed=8))
    assert other_seed != first


@pytest.mark.parametrize(
    ("counts", "batch_size", "micro"),
    [([7, 30, 0, 12], 5, 3), ([3, 3, 3], 2, 2), ([2, 1, 2, 1, 2], 2, 1), ([50, 1], 9, 9)],
)
def test_batches_do_not_depend_on_arrival_order(counts: list[int], batch_size: int, micro: int) -> None:
    """Feed the assembler every worker's messages in random interleavings."""
    loader = MixedLoader(Tagged(counts), batch_size, num_workers=len(counts), seed=3)
    streams = [
        [
            (w, len(chunk), default_collate([make_sample(w, i) for i in chunk]), None, None, None)
            for chunk in (range(s, min(s + micro, n)) for s in range(0, n, micro))
        ]
        + [(w, 0, None, None, None, None)]
        for w, n in enumerate(counts)
    ]
    rng = random.Random(0)
    results = []
    for _ in range(40):
        queues = [list(stream) for stream in streams]
        arrivals = []
        while any(queues):
            arrivals.append(rng.choice([q for q in queues if q]).pop(0))
        results.append([ids(batch) for batch in _Mixer(loader, iter(arrivals))])
    assert all(result == results[0] for result in results)
    check_shares(results[0], counts, batch_size)
    assert sorted(s for b in results[0] for s in b) == [(w, i) for w, n in enumerate(counts) for i in range(n)]


def test_epoch_reaches_dataset_and_changes_order_with_persistent_workers() -> None:
    dataset = Tagged([20, 20])
    loader = MixedLoader(dataset, 6, num_workers=2, persistent_workers=True, prefetch_factor=3)
    epoch0 = run(loader)
    loader.set_epoch(1)
    epoch1 = run(loader)
    assert dataset.epochs == [1]
    assert epoch0 != epoch1
    for batches in (epoch0, epoch1):
        check_shares(batches, [20, 20], 6)
    loader.set_epoch(0)
    assert run(loader) == epoch0


def test_ranks_with_equal_totals_yield_equal_batch_counts() -> None:
    # Same samples per rank, split differently over the workers.
    counts_per_rank = [[10, 10, 10], [30, 0, 0], [1, 2, 27]]
    for drop_last in (False, True):
        lengths = {len(run(MixedLoader(Tagged(c), 7, num_workers=3, drop_last=drop_last))) for c in counts_per_rank}
        assert lengths == {4 if drop_last else 5}


@pytest.mark.parametrize("balance", ["pad", "drop"])
def test_ranks_of_a_shardkit_source_yield_equal_batch_counts(balance: str) -> None:
    lengths = set()
    for rank in range(3):
        source = wrap(list(range(103)), rank=rank, world_size=3, balance=balance)
        loader = MixedLoader(source, 8, num_workers=2)
        batches = list(loader)
        assert len(loader) == len(batches)
        assert len({int(x) for b in batches for x in b}) == sum(len(b) for b in batches)
        lengths.add(len(batches))
    assert lengths == {5}


def test_custom_collate_fn_sees_whole_batches() -> None:
    calls: list[int] = []

    def pad(samples: list[dict[str, Any]]) -> dict[str, Any]:
        calls.append(len(samples))
        width = max(s["index"] % 3 + 1 for s in samples)
        padded = torch.zeros(len(samples), width, dtype=torch.long)
        for row, s in enumerate(samples):
            padded[row, : s["index"] % 3 + 1] = s["worker"] + 1
        return {"ids": [(s["worker"], s["index"]) for s in samples], "padded": padded}

    counts = [9, 14]
    loader = MixedLoader(Tagged(counts), 5, num_workers=2, collate_fn=pad)
    batches = list(loader)
    assert calls == [5, 5, 5, 5, 3]
    check_shares([b["ids"] for b in batches], counts, 5)
    for batch in batches:
        assert batch["padded"].shape[1] == max(i % 3 + 1 for _, i in batch["ids"])


def test_no_workers_batches_plainly() -> None:
    dataset = Tagged([11])
    mixed = [ids(b) for b in MixedLoader(dataset, 4)]
    plain = [ids(b) for b in DataLoader(dataset, batch_size=4)]
    assert mixed == plain == [[(0, i) for i in range(s, min(s + 4, 11))] for s in range(0, 11, 4)]
    assert [len(ids(b)) for b in MixedLoader(dataset, 4, drop_last=True)] == [4, 4]


class Images(IterableDataset):
    """Ten 3x224x224 images per worker, filled with the worker id."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __iter__(self) -> Iterator[torch.Tensor]:
        worker = get_worker_info().id
        return (torch.full((3, 224, 224), worker, dtype=self.dtype) for _ in range(10))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
def test_large_tensor_samples(dtype: torch.dtype) -> None:
    batches = list(MixedLoader(Images(dtype), 8, num_workers=2))
    assert [b.shape for b in batches] == [torch.Size([8, 3, 224, 224])] * 2 + [torch.Size([4, 3, 224, 224])]
    for batch in batches:
        assert batch.dtype == dtype
        assert Counter(batch[:, 0, 0, 0].tolist()) == {0: len(batch) // 2, 1: len(batch) // 2}
        assert all(torch.equal(image, torch.full_like(image, image[0, 0, 0])) for image in batch)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 3])
def test_len(drop_last: bool, num_workers: int) -> None:
    counts = [10, 4, 9] if num_workers else [23]
    loader = MixedLoader(Tagged(counts, sized=True), 5, num_workers=num_workers, drop_last=drop_last)
    assert len(loader) == (4 if drop_last else 5) == len(list(loader))


def test_len_without_dataset_length() -> None:
    with pytest.raises(TypeError, match="Unsized does not define __len__"):
        len(MixedLoader(Unsized(), 2, num_workers=1))


def test_pin_memory_without_accelerator_warns_and_yields() -> None:
    if _accelerator_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator"):
        loader = MixedLoader(Tagged([3, 3]), 4, num_workers=2, pin_memory=True, timeout=30)
    assert [len(ids(b)) for b in loader] == [4, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, r"batch_size must be an int >= 1, got 0 \(int\)"),
        ({"batch_size": "8"}, r"batch_size must be an int >= 1, got '8' \(str\)"),
        ({"batch_size": True}, r"batch_size must be an int >= 1, got True \(bool\)"),
        ({"num_workers": -1}, "num_workers must be an int >= 0, got -1"),
        ({"seed": -3}, "seed must be an int >= 0, got -3"),
        ({"micro_batch_size": 0}, "micro_batch_size must be an int >= 1, got 0"),
        ({"collate_fn": 3}, "collate_fn must be callable"),
        ({"drop_last": 1}, "drop_last must be a bool"),
        ({"resumable": "yes"}, "resumable must be a bool"),
        ({"dataset": [1, 2, 3]}, "map-style dataset use torch.utils.data.DataLoader"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"dataset": Tagged([1]), "batch_size": 2, **kwargs}
    with pytest.raises(LoaderError, match=message) as error:
        MixedLoader(arguments.pop("dataset"), arguments.pop("batch_size"), **arguments)
    assert isinstance(error.value, ShardkitError) and isinstance(error.value, ValueError)


@pytest.mark.parametrize("name", ["shuffle", "sampler", "batch_sampler", "in_order", "bogus"])
def test_unknown_dataloader_arguments(name: str) -> None:
    with pytest.raises(TypeError, match=f"unexpected keyword argument.*{name}.*passes only"):
        MixedLoader(Tagged([1]), 2, num_workers=1, **{name: None})


def test_invalid_epoch() -> None:
    with pytest.raises(LoaderError, match="epoch must be an int >= 0, got -1"):
        MixedLoader(Tagged([1]), 2).set_epoch(-1)


class FailsWhileMarked(IterableDataset):
    """Ints 0..39 split over the workers; record 21 raises, naming its worker's pid, while ``marker`` exists."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for sample in range(worker, 40, workers):
            if sample == 21 and os.path.exists(self.marker):
                raise RuntimeError(f"record 21 is bad (worker pid {os.getpid()})")
            yield sample


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_error_stops_the_workers_at_once_and_the_next_epoch_starts_anew(tmp_path, persistent):
    marker = tmp_path / "bad"
    marker.touch()
    loader = MixedLoader(FailsWhileMarked(str(marker)), 4, num_workers=2, persistent_workers=persistent)
    with pytest.raises(RuntimeError, match=r"record 21 is bad") as error:
        list(loader)
    pid = int(re.search(r"worker pid (\d+)", str(error.value)).group(1))
    # The error, still held here, keeps the DataLoader iterator alive; its workers must be gone anyway
    # (left to the cycle collector they would wait 5 s each before being terminated).
    assert not _process_exists(pid)
    del error  # its traceback would keep this test's frame, and with it the next epoch's persistent workers
    marker.unlink()
    assert sorted(int(sample) for batch in loader for sample in batch) == list(range(40))


def test_iter_alone_starts_no_worker_and_counts_no_pass() -> None:
    # Trainers call iter() on a loader to check it before they load its state (Lightning's
    # _check_dataloader_iterable): that call must neither start workers nor move the epoch on.
    def batches(loader: MixedLoader) -> list[list[int]]:
        return [batch.tolist() for batch in loader]

    def build() -> MixedLoader:
        return MixedLoader(wrap(list(range(48)), shuffle=True, seed=3), 6, num_workers=2, persistent_workers=True)

    reference = build()
    epoch0, epoch1 = batches(reference), batches(reference)
    assert epoch0 != epoch1  # each pass reshuffles, so a pass counted by iter() would show
    checked = build()
    running = set(multiprocessing.active_children())
    iter(checked)
    assert set(multiprocessing.active_children()) == running
    assert batches(checked) == epoch0 and batches(checked) == epoch1
