"""A MixedLoader's workers answer a save with their dataset state at the delivered point, made again
from a restart point (``shardkit.loader.restart``; issue 39, item 1).

Packed blocks cannot be read again by position, so before this every block a worker had made and
the batches had not delivered (the rest of a cut micro-batch, the queued and in-flight ones)
travelled in the saved state as data: about 8 KB a block of 2048 int32 tokens, 440 KB per rank for
``TokenDataset.pack(2048)`` under ``MixedLoader(batch_size=8, num_workers=2)``. Now nothing is
carried: the state is the workers' dataset states at the delivered point, under 4 KB per rank.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardkit
from shardkit.loader import restart
from shardkit.state import StateError
from tests.helpers.tokens import DOCS, write_pair

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """About 400k int32 tokens in documents of lognormal length (median 400), as benchmarks/state.py writes them."""
    rng = np.random.default_rng(1)
    docs, written = [], 0
    while written < 400_000:
        docs.append(rng.integers(0, 50_000, max(1, int(rng.lognormal(np.log(400), 1.0))), dtype=np.int32))
        written += len(docs[-1])
    return write_pair(tmp_path_factory.mktemp("tokens"), docs, dtype=np.int32)


def loader(prefix: str, workers: int = 2) -> shardkit.MixedLoader:
    """Pads with -1 (not a token): another worker count pads the ends of other readers' last blocks.
    Micro-batches of 8: the 196 blocks are then many messages, so the cuts leave both workers running
    (grown to 64 blocks a message, each worker would have sent its last by the first batch;
    tests/loader/test_message_size.py saves a larger corpus mid-epoch with grown ones)."""
    pipeline = shardkit.TokenDataset(prefix).pack(2048, pad_id=-1)
    return shardkit.MixedLoader(pipeline, batch_size=8, num_workers=workers, micro_batch_size=8)


def saved_bytes(state: Any) -> int:
    out = io.BytesIO()
    torch.save(state, out)  # as a trainer's checkpoint holds it
    return len(out.getvalue())


def saved_after(built: shardkit.MixedLoader, steps: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(the blocks of the first ``steps`` batches, the state then, through JSON)."""
    iterator, delivered = iter(built), []
    for _ in range(steps):
        delivered.append(next(iterator)["input_ids"])
    state = json.loads(json.dumps(built.state_dict()))
    del iterator
    return delivered, state


def same_blocks(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow
def test_a_packed_token_loader_state_is_under_4_kb_per_rank_at_every_cut_and_resumes_token_for_token(
    prefix: str,
) -> None:
    """Before: 200-600 KB per rank (the undelivered blocks as data). The cuts leave both workers
    running (each is at most its prefetch and one queued micro-batch ahead): a worker that has sent
    its last micro-batch can answer no more, so near the epoch's end what it made is carried."""
    full = [batch["input_ids"] for batch in loader(prefix)]
    assert len(full) == 25
    for cut in (1, 3, 11, 17):
        saving = loader(prefix)
        delivered, state = saved_after(saving, cut)
        assert saving.stats().carried_as == "restart"
        assert state["carry"] == [], "nothing carried: each worker's state is at the delivered point"
        assert saved_bytes(state) <= 4096 and len(pickle.dumps(state)) <= 4096, cut
        resumed = loader(prefix)
        resumed.load_state_dict(state)
        rest = [batch["input_ids"] for batch in resumed]
        assert same_blocks(delivered + rest, full), cut


@pytest.mark.slow
def test_states_saved_after_every_batch_of_one_run_each_resume_the_uninterrupted_blocks(tmp_path: Path) -> None:
    """Each save asks the workers again for the point delivered then (micro-batches of 3 in batches of 4).
    A save receives messages up to the answer, so the workers run ahead: these 37 blocks a worker have
    all been made by the fifth save, after which what they made is carried."""

    tokens = write_pair(tmp_path, dtype=np.int32)

    def small() -> shardkit.MixedLoader:
        pipeline = shardkit.TokenDataset(tokens, shuffle=True, seed=4).pack(16)
        return shardkit.MixedLoader(pipeline, 4, num_workers=2, micro_batch_size=3)

    full = [batch["input_ids"] for batch in small()]
    saving, states = small(), []
    for batch in saving:
        states.append(json.loads(json.dumps(saving.state_dict())))
    assert not any(state["carry"] for state in states[:3]), "no carry while the workers run"
    for step in (1, 3, len(full) - 1):
        resumed = small()
        resumed.load_state_dict(states[step - 1])
        assert same_blocks([batch["input_ids"] for batch in resumed], full[step:]), step


@pytest.mark.slow
def test_a_state_made_at_the_delivered_point_resumes_on_another_worker_count_every_token_once(prefix: str) -> None:
    full = torch.cat([batch["input_ids"].flatten() for batch in loader(prefix)])
    delivered, state = saved_after(loader(prefix), 5)
    for workers in (1, 3):
        resumed = loader(prefix, workers)
        resumed.load_state_dict(state)
        tokens = torch.cat([block.flatten() for block in delivered + [b["input_ids"] for b in resumed]])
        assert torch.equal(tokens[tokens != -1].sort().values, full[full != -1].sort().values), workers


@pytest.mark.slow
def test_without_a_restart_point_near_the_delivered_point_the_blocks_are_carried_and_resume_exactly(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers (forked) see the patched bound: no point is close enough, so they answer with their state
    after the micro-batch they send and the blocks before it travel as data, as before."""
    monkeypatch.setattr(restart, "MAX_SKIP", 0)
    full = [batch["input_ids"] for batch in loader(prefix)]
    delivered, state = saved_after(loader(prefix), 3)
    assert state["carry"] and all("payload" in tail for tail in state["carry"])
    resumed = loader(prefix)
    resumed.load_state_dict(state)
    assert same_blocks(delivered + [batch["input_ids"] for batch in resumed], full)


def test_a_plain_iterable_keeps_no_restart_points_and_its_samples_are_carried_as_data() -> None:
    """It may not give the same items twice: what its workers made stays data (stats say so)."""
    assert not restart.restartable(shardkit.wrap(iter(range(10))).map(int))
    assert restart.restartable(shardkit.wrap(list(range(10))).map(int).batch(2))
    built = shardkit.MixedLoader(shardkit.wrap(iter(range(10))), batch_size=2, num_workers=2)
    assert built.stats().carried_as == "data"


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_token_file_replaced_while_it_is_read_is_a_state_error_naming_it_when_saving(tmp_path: Path) -> None:
    """Before: the save carried the blocks as data and went unnoticed until a resume."""
    prefix = write_pair(tmp_path, dtype=np.int32)
    pipeline = shardkit.TokenDataset(prefix, shuffle=True, seed=4).pack(16, pad_id=-1)
    built = shardkit.MixedLoader(pipeline, 4, num_workers=2, micro_batch_size=3)
    iterator = iter(built)
    for _ in range(4):  # past the restart point each worker keeps after its first micro-batch: pieces by position
        next(iterator)
    other = [doc[::-1].copy() for doc in DOCS]  # same lengths, so the same counts and .idx sizes
    os.replace(write_pair(tmp_path, other, name="y", dtype=np.int32) + ".bin", prefix + ".bin")
    with pytest.raises(StateError, match=r"shard 0 \(.*x\.bin\) is not the file it was when the state was saved"):
        built.state_dict()


def test_samples_made_again_that_end_before_the_point_are_a_state_error_never_a_short_state(tmp_path: Path) -> None:
    """A restart point whose stream, read again, ends before the samples it had made (a shard cut short
    since) is refused naming the dataset, not saved as the end of the stream."""
    prefix = write_pair(tmp_path, dtype=np.int32)
    pipeline = shardkit.TokenDataset(prefix).pack(16, pad_id=-1)
    blocks = list(pipeline)
    iterator = iter(pipeline)
    next(iterator)
    point = pipeline.state_dict()
    with pytest.raises(StateError, match=rf"made {len(blocks) + 4} samples .* ends after {len(blocks) - 1}.*x\.bin"):
        restart.remade(pipeline, point, len(blocks) + 4)
    assert restart.remade(pipeline, point, len(blocks) - 1)["kind"] == point["kind"]  # the stream's end is fine


def test_restart_points_are_kept_in_order_and_an_answer_starts_from_the_latest_at_or_before_the_point() -> None:
    points = restart.RestartPoints(dataset=None)  # answers at kept points need no dataset: nothing is made again
    for made in (0, 10, 20):
        points.made = made
        points.keep({"at": made})
    points.made = 25
    points.keep({"at": 15}, 15)  # a state made at a point asked for, kept between the others
    points.keep("MixedLoader cannot save its position: ...")  # a failure message is no restart point
    assert [made for made, _ in points._points] == [0, 10, 15, 20]
    assert points.state_at(15) == {"at": 15} and points.state_at(20) == {"at": 20}
    assert points.state_at(26) is None, "past what the worker made"
    for made in range(30, 30 + restart.KEPT):
        points.made = made
        points.keep({"at": made})
    points.keep({"at": 1}, 1)  # older than every point kept: dropped, not kept in place of a newer one
    assert [made for made, _ in points._points] == list(range(30, 30 + restart.KEPT))
