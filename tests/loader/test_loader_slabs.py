"""MixedLoader's slab transport: byte-exact batches, exactly once and equal counts over ranks with
0, 2 or 3 workers under fork and spawn, pin_memory, resume, no leaked shared memory.

Every batch is compared with ``default_collate`` of the samples it names, after
the whole epoch has been collected, so a batch that still pointed into a slab
the worker reused would show up as wrong values.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import signal
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from shardkit import MixedLoader, ShardedDataset
from shardkit.loader.mixed import _accelerator_available
from shardkit.loader.mixer import Mixer as _Mixer
from shardkit.loader.slabs import SlabBatch, SlabRing, from_slab
from tests.helpers.processes import REPO, last_json_line, run_python
from tests.helpers.reading import assert_same
from tests.helpers.shards import all_ids, synthetic_read, synthetic_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Pair(NamedTuple):
    left: torch.Tensor
    right: int


def sample(worker: int, index: int) -> dict[str, Any]:
    """A sample with every leaf type default_collate turns into a tensor, and some it keeps."""
    seed = worker * 1000 + index
    return OrderedDict(
        worker=worker,
        index=index,
        image=torch.full((3, 5, 7), seed % 251, dtype=torch.uint8),
        weights=torch.arange(4, dtype=torch.bfloat16) * index,
        mask=torch.tensor([index % 2 == 0, True]),
        array=np.array([[seed, -seed]], dtype=np.int16),
        scalar=np.float32(index / 3),
        ratio=index / 7,
        flag=index % 3 == 0,
        name=f"{worker}:{index}",
        blob=bytes([seed % 256]) * (index % 5),
        pair=Pair(torch.tensor([float(index)]), seed),
        nested=[torch.tensor(index, dtype=torch.int64), (index, "x")],
        empty=torch.empty((0, 2)),
    )


RELEASE = "SHARDKIT_TEST_RELEASE"


def pause_until_killed_or_released(seconds: float = 60) -> None:
    """A worker's pause: until it is killed, or the file named by $SHARDKIT_TEST_RELEASE exists.

    Released, a paused worker that was not killed finishes its fetch and exits as asked;
    asleep, it would hold the loader's shutdown 5 s (DataLoader's join timeout) before its
    SIGTERM."""
    release, deadline = os.environ.get(RELEASE), time.monotonic() + seconds
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.01)


class Samples(IterableDataset):
    """Worker ``w`` yields ``counts[w]`` samples; in the main process, ``counts[0]`` as worker 0."""

    def __init__(self, counts: list[int], *, pause_after: int = -1) -> None:
        self.counts = counts
        self.pause_after = pause_after

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for index in range(self.counts[worker]):
            if index == self.pause_after:
                pause_until_killed_or_released()
            yield sample(worker, index)


def check_batches(batches: list[Any], counts: list[int], batch_size: int) -> None:
    """Exactly once, ceil(n / batch_size) batches, each byte-exact against default_collate."""
    assert len(batches) == math.ceil(sum(counts) / batch_size)
    seen = []
    for number, batch in enumerate(batches):
        names = list(zip(batch["worker"].tolist(), batch["index"].tolist()))
        seen += names
        assert_same(batch, default_collate([sample(w, i) for w, i in names]), f"batch {number}")
    assert sorted(seen) == [(w, i) for w, n in enumerate(counts) for i in range(n)]


def torch_shm_maps() -> list[str]:
    """This process's mappings of torch shared memory."""
    with open("/proc/self/maps") as maps:
        return [line.split()[-2] for line in maps if "/dev/shm/torch_" in line]


def shm_files_of(pids: list[int]) -> list[str]:
    """Files torch left in /dev/shm for these processes (it names them torch_<pid>_...)."""
    return [name for name in os.listdir("/dev/shm") if any(name.startswith(f"torch_{pid}_") for pid in pids)]


def from_ring(ring: SlabRing, chunk: list[Any], slabs: dict[int, torch.Tensor]) -> Any:
    """What the main process makes of ``ring.collate(chunk)``."""
    out = ring.collate(chunk)
    if not isinstance(out, SlabBatch):
        return out
    if out.slab is not None:
        slabs[out.slot] = out.slab
    return from_slab(out.skeleton, slabs[out.slot])


def test_slab_collate_is_default_collate_byte_for_byte() -> None:
    ring, slabs = SlabRing(4), {}
    for size in (1, 3, 8):
        chunk = [sample(1, i) for i in range(size)]
        assert_same(from_ring(ring, chunk, slabs), default_collate(chunk))
        ring.flags.zero_()


def test_a_ring_without_a_free_slot_sends_what_default_collate_makes() -> None:
    ring = SlabRing(1)
    chunk = [sample(0, i) for i in range(4)]
    first = ring.collate(chunk)
    assert isinstance(first, SlabBatch) and first.slab is not None
    second = ring.collate(chunk)
    assert not isinstance(second, SlabBatch)
    assert_same(second, default_collate(chunk))
    ring.flags[0] = 0  # the main process copied the first one out
    third = ring.collate(chunk)
    assert isinstance(third, SlabBatch) and third.slot == 0 and third.slab is None  # the buffer is reused


def test_a_larger_micro_batch_gets_a_larger_buffer_in_its_slot() -> None:
    ring, slabs = SlabRing(1), {}
    for size in (1, 2, 30):
        chunk = [sample(2, i) for i in range(size)]
        assert_same(from_ring(ring, chunk, slabs), default_collate(chunk))
        ring.flags[0] = 0
    assert len(slabs[0]) >= 30 * 3 * 5 * 7


class Subclass(torch.Tensor):
    pass


def test_tensors_a_slab_cannot_hold_travel_as_default_collate_makes_them() -> None:
    chunk = [torch.empty(2, device="meta") for _ in range(3)]
    out = SlabRing(2).collate(chunk)
    assert not isinstance(out, SlabBatch)
    assert out.device.type == "meta" and out.shape == (3, 2)
    chunk = [{"x": torch.arange(3).as_subclass(Subclass) + i} for i in range(2)]
    out = SlabRing(2).collate(chunk)
    assert not isinstance(out, SlabBatch)
    assert_same(out, default_collate(chunk))
    assert type(out["x"]) is Subclass


def collect(loader: MixedLoader) -> tuple[list[Any], bool]:
    """Every batch of an epoch, and whether slabs carried them (seen after the first batch)."""
    batches, used = [], False
    for batch in loader:
        batches.append(batch)
        if loader._mixer is not None:
            used = used or any(loader._mixer._slabs)
    return batches, used


def test_no_workers_batches_are_default_collate() -> None:
    batches, used = collect(MixedLoader(Samples([23]), 5))
    check_batches(batches, [23], 5)
    assert not used


@pytest.mark.slow
@pytest.mark.parametrize(
    ("counts", "micro", "context"),
    # spawn once, on the cheapest case: spawned workers import torch again (seconds each), and
    # what spawn changes (the ring pickled to the workers) does not depend on the counts
    [([40, 25], None, "fork"), ([40, 25], None, "spawn"), ([31, 2, 17], 4, "fork")],
)
def test_slab_batches_are_exact_and_exactly_once(counts: list[int], micro: int | None, context: str) -> None:
    loader = MixedLoader(
        Samples(counts), 8, num_workers=len(counts), micro_batch_size=micro, multiprocessing_context=context
    )
    batches, used = collect(loader)
    assert used
    check_batches(batches, counts, 8)


def rank_batches(rank: int, num_workers: int, context: str) -> list[dict[str, Any]]:
    """One epoch of rank ``rank`` of 2 through MixedLoader, byte-checked; 57 records, so "drop" leaves one out."""
    shards = synthetic_shards([17, 3, 0, 25, 12])
    dataset = ShardedDataset(shards, synthetic_read, balance="drop", shuffle=True, seed=5, rank=rank, world_size=2)
    context_kwargs = {"multiprocessing_context": context} if num_workers else {}
    loader = MixedLoader(dataset.map(labelled), 5, num_workers=num_workers, micro_batch_size=3, **context_kwargs)
    batches, used = collect(loader)
    assert used == (num_workers > 0)
    assert len(batches) == len(loader)
    for batch in batches:
        check_labelled(batch)
    return batches


@pytest.mark.slow
# fork only: spawned workers through the slabs are test_slab_batches_are_exact_and_exactly_once[spawn]'s;
# the split over ranks does not depend on how the workers start
@pytest.mark.parametrize(("num_workers", "context"), [(0, ""), (2, "fork"), (3, "fork")])
def test_ranks_get_exactly_once_and_equal_batch_counts_through_the_slabs(num_workers: int, context: str) -> None:
    ranks = [rank_batches(rank, num_workers, context) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == math.ceil(28 / 5)
    seen = [record for batches in ranks for batch in batches for record in batch["id"]]
    everything = all_ids(synthetic_shards([17, 3, 0, 25, 12]))
    assert len(seen) == len(set(seen)) == 56 and set(seen) < set(everything)


@pytest.mark.slow
def test_micro_batches_without_a_free_slot_mix_with_slab_ones_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    kinds: Counter[str] = Counter()
    pull = _Mixer._pull

    def counting_pull(self: _Mixer) -> None:
        before = [len(queue) for queue in self._pending]
        pull(self)
        for queue, length in zip(self._pending, before):
            if len(queue) > length:
                kinds["plain" if queue[-1].slot is None else "slab"] += 1

    monkeypatch.setattr(_Mixer, "_pull", counting_pull)
    loader = MixedLoader(Samples([50, 37]), 8, num_workers=2, micro_batch_size=3)
    loader._micro_batches.slots = 1  # most micro-batches find the one slot busy
    batches, used = collect(loader)
    assert kinds["slab"] and kinds["plain"], kinds
    check_batches(batches, [50, 37], 8)


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [tensor for item in items for tensor in tensors_of(item)]


def pin_memory_warning() -> Any:
    """Without an accelerator, pin_memory=True warns (and does not fail)."""
    return nullcontext() if _accelerator_available() else pytest.warns(UserWarning, match="accelerator")


def check_pinned(batches: list[Any]) -> None:
    """Pinned where pinning is possible: every tensor of every batch, with an accelerator."""
    if _accelerator_available():
        assert all(tensor.is_pinned() for batch in batches for tensor in tensors_of(batch))


@pytest.mark.slow
def test_persistent_workers_and_pin_memory_keep_batches_exact() -> None:
    with pin_memory_warning():
        loader = MixedLoader(Samples([20, 13]), 6, num_workers=2, persistent_workers=True, pin_memory=True)
    for _ in range(3):  # each epoch gives the workers a new ring
        batches, used = collect(loader)
        assert used
        check_batches(batches, [20, 13], 6)
        check_pinned(batches)


def test_pin_memory_without_workers_yields_exact_batches() -> None:
    with pin_memory_warning():
        batches, _ = collect(MixedLoader(Samples([11]), 4, pin_memory=True))
    check_batches(batches, [11], 4)
    check_pinned(batches)


def labelled(record: str) -> dict[str, Any]:
    number = int(record.rsplit(":", 1)[1]) + 7 * len(record)
    return {"id": record, "image": torch.full((3, 4, 4), number % 251, dtype=torch.uint8), "label": number}


def resumable_loader(num_workers: int = 2, context: str = "fork") -> MixedLoader:
    dataset = ShardedDataset(synthetic_shards([7, 13, 5, 20, 9]), synthetic_read, shuffle=True, seed=3)
    return MixedLoader(
        dataset.map(labelled), 8, num_workers=num_workers, micro_batch_size=3, multiprocessing_context=context
    )


def check_labelled(batch: dict[str, Any]) -> None:
    assert_same(batch, default_collate([labelled(record) for record in batch["id"]]))


def saved_after(loader: MixedLoader, stop: int) -> tuple[list[list[str]], Any]:
    """The record ids of the first ``stop`` batches, and the state after them (through JSON, as a checkpoint)."""
    ids = []
    for batch in loader:
        check_labelled(batch)
        ids.append(batch["id"])
        if len(ids) == stop:
            return ids, json.loads(json.dumps(loader.state_dict()))
    raise AssertionError(f"the epoch ended before batch {stop}")


def resumed_from(state: Any, num_workers: int, context: str = "fork") -> list[list[str]]:
    """The record ids of an epoch's batches, resumed from ``state`` (None: the whole epoch)."""
    loader = resumable_loader(num_workers, context)
    if state is not None:
        loader.load_state_dict(state)
    rest = []
    for batch in loader:
        check_labelled(batch)
        rest.append(batch["id"])
    return rest


@pytest.mark.slow
@pytest.mark.parametrize(("context", "stops"), [("fork", (1, 3, 5)), ("spawn", (2,))])
def test_slab_batches_resume_mid_epoch_with_the_same_batches(context: str, stops: tuple[int, ...]) -> None:
    # Only the resumed loader starts its workers with ``context``: the state reaches spawned
    # workers pickled. The epoch and the run saved from are forked (the batches do not depend
    # on how workers start), which saves two spawned starts.
    full = resumed_from(None, 2)
    assert len(full) == math.ceil(54 / 8)
    for stop in stops:
        first, state = saved_after(resumable_loader(2), stop)
        assert first + resumed_from(state, 2, context) == full, f"resumed after batch {stop}"


@pytest.mark.slow
@pytest.mark.parametrize(("saved_workers", "resumed_workers"), [(2, 3), (3, 2)])
def test_slab_batches_resumed_with_another_worker_count_deliver_the_rest_exactly_once(
    saved_workers: int, resumed_workers: int
) -> None:
    first, state = saved_after(resumable_loader(saved_workers), 3)
    rest = resumed_from(state, resumed_workers, "fork")
    seen = [record for batch in first + rest for record in batch]
    assert len(seen) == len(set(seen)) == 54
    assert len(rest) == math.ceil((54 - 24) / 8)


def worker_pids(loader: MixedLoader) -> list[int]:
    """The pids of the workers of the epoch being iterated."""
    assert loader._mixer is not None and loader._mixer._source is not None
    return [worker.pid for worker in loader._mixer._source._workers]  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_no_shared_memory_stays_after_an_epoch_or_del_loader(persistent: bool) -> None:
    before = set(torch_shm_maps())  # an earlier test's tensors may be freed meanwhile: only new maps count

    def new_maps() -> list[str]:
        return [name for name in torch_shm_maps() if name not in before]

    loader = MixedLoader(Samples([30, 30]), 8, num_workers=2, persistent_workers=persistent)
    iterator = iter(loader)
    next(iterator)
    pids = worker_pids(loader)
    assert new_maps()  # the rings are mapped mid-epoch
    for _ in iterator:
        pass
    assert new_maps() == [], "an epoch's slabs are still mapped after it ended"
    assert shm_files_of([os.getpid(), *pids]) == []
    iterator = iter(loader)
    next(iterator)
    pids += worker_pids(loader)
    assert new_maps()
    del iterator, loader
    gc.collect()
    assert new_maps() == [], "slabs are still mapped after del loader"
    assert shm_files_of([os.getpid(), *pids]) == []


KILL_SCRIPT = """
import gc, json, os, signal, sys, time
sys.path.insert(0, {repo!r})
from shardkit import MixedLoader
from tests.loader.test_loader_slabs import RELEASE, torch_shm_maps, worker_pids
{imports}

if __name__ == "__main__":  # spawned workers import this script again
    os.environ[RELEASE] = {release!r}  # the workers inherit it
    before = torch_shm_maps()
    loader = MixedLoader({dataset}, 4, num_workers=2, timeout=30, multiprocessing_context={context!r})
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    pids = worker_pids(loader)
    for _ in range(3000 if {pause!r} else 0):  # killed while it waits, not inside torch's creation of a segment
        if os.path.exists({pause!r} + ".1"):
            break
        time.sleep(0.01)
    error = ""
    try:
        os.kill(pids[1], signal.SIGKILL)
        for _ in iterator:
            pass
    except (RuntimeError, ConnectionError) as caught:
        error = f"{{type(caught).__name__}}: {{caught}}"
        del caught
    open({release!r}, "w").close()  # the worker still paused ends its fetch and exits when told
    del iterator, loader
    gc.collect()
    print(json.dumps({{"error": error, "pid": os.getpid(), "pids": pids, "before": before, "after": torch_shm_maps()}}))
"""


def assert_a_killed_worker_leaves_nothing(
    tmp_path: Path, context: str, dataset: str, imports: str = "", pause: str = ""
) -> None:
    """Kill worker 1 of a MixedLoader over ``dataset`` (source text; ``imports`` make it, ``pause``
    is the file prefix its workers touch when they wait) three batches in: the death is reported
    and nothing stays mapped or in /dev/shm.

    In a process of its own: DataLoader's SIGCHLD handler may raise at any later point.
    """
    script = tmp_path / "kill.py"
    script.write_text(
        KILL_SCRIPT.format(
            repo=str(REPO),
            context=context,
            dataset=dataset,
            imports=imports,
            pause=pause,
            release=str(tmp_path / "release"),
        )
    )
    report = last_json_line(run_python(str(script), timeout=120, cwd=REPO).stdout)
    # DataLoader reports the death from its SIGCHLD handler wherever the main process is;
    # met while MixedLoader receives a message (a read, or a file descriptor the dead worker
    # was passing), the error names the worker.
    dead = rf"RuntimeError: DataLoader worker \(pid(\(s\))? {report['pids'][1]}\) (is killed|exited)"
    named = rf"WorkerDiedError: MixedLoader: DataLoader worker 1 \(pid {report['pids'][1]}\) died"
    assert re.match(dead, report["error"]) or re.match(named, report["error"]), report["error"]
    assert report["after"] == report["before"]
    assert shm_files_of([report["pid"], *report["pids"]]) == []


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_no_shared_memory_stays_after_a_worker_is_killed(tmp_path: Path, context: str) -> None:
    dataset = "Samples([40, 40], pause_after=20)"
    assert_a_killed_worker_leaves_nothing(
        tmp_path, context, dataset, "from tests.loader.test_loader_slabs import Samples"
    )


@pytest.mark.slow
@pytest.mark.parametrize("prefetch_factor", [None, 1, 4])
def test_any_prefetch_factor_sizes_the_ring(prefetch_factor: int | None) -> None:
    loader = MixedLoader(Samples([9, 14]), 4, num_workers=2, prefetch_factor=prefetch_factor)
    assert loader._micro_batches.slots == 3 + (prefetch_factor or 2)
    batches, used = collect(loader)
    assert used
    check_batches(batches, [9, 14], 4)


class DiesAfterSending(IterableDataset):
    """Yields 4-element tensors; after its second micro-batch of 4 went to the queue (the main
    process asks for a third after taking the first), the
    worker waits for it to be written, touches ``marker`` and SIGKILLs itself."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __iter__(self) -> Iterator[torch.Tensor]:
        for index in range(40):
            if index == 8:  # micro-batch 3 is being made: micro-batch 2 was put in the queue
                time.sleep(1.0)  # the queue's feeder thread writes it
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
            yield torch.full((4,), index)

    def __repr__(self) -> str:
        return "DiesAfterSending()"


DIES_SCRIPT = """
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
from shardkit import MixedLoader
from tests.loader.test_loader_slabs import DiesAfterSending, worker_pids

# DataLoader's SIGCHLD handler would report the death wherever the main process is; blocked,
# the death is found as it is when the handler comes late: by reading the dead worker's message.
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
loader = MixedLoader(DiesAfterSending({marker!r}), 4, num_workers=1, timeout=30)
iterator = iter(loader)
next(iterator)
pid = worker_pids(loader)[0]
deadline = time.monotonic() + 60
while not os.path.exists({marker!r}) and time.monotonic() < deadline:
    time.sleep(0.01)
while open(f"/proc/{{pid}}/stat").read().split()[2] != "Z" and time.monotonic() < deadline:  # dead, not reaped
    time.sleep(0.01)
try:
    for _ in range(2):  # batch 2: the message in the pipe, whose slab the dead worker was to hand over
        next(iterator)
    error = "no error"
except Exception as caught:
    error = f"{{type(caught).__name__}}: {{caught}}"
print(json.dumps({{"error": error, "pid": pid}}))
"""


@pytest.mark.slow
def test_a_worker_killed_while_its_message_is_read_is_named_with_its_pid_signal_and_dataset(tmp_path: Path) -> None:
    """Before: DataLoader's RuntimeError naming a pid only (or a bare EOFError when the read lost the race)."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_SCRIPT.format(repo=str(REPO), marker=str(tmp_path / "sent")))
    report = last_json_line(run_python(str(script), timeout=120, cwd=REPO).stdout)
    assert report["error"].startswith("WorkerDiedError: "), report["error"]
    assert f"worker 0 (pid {report['pid']}) died, killed by SIGKILL" in report["error"]
    assert "reading DiesAfterSending()" in report["error"]
