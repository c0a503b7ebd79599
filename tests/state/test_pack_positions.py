"""``.pack()`` buffers saved as positions, cut again from their documents read again (issue 39, item 1).

A pack stage over an input that reads its records again (``TokenDataset`` and
other shard sources, through maps, filters and shuffles) saves each piece it
holds as its document's (shard, record) position and the index of its first
token in the document, not the tokens: the state's size does not depend on
the documents' lengths and grows by at most 16 bytes per held piece. On
restore the documents are read again (a map applied again with
``record_seed()``) after their shards' identities are checked, and the blocks
that follow are the uninterrupted run's, token for token.
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
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

import shardkit
from shardkit.state import StateError, decode_positions, encode, merge_ranks
from tests.helpers.examples import examples
from tests.helpers.tokens import DOCS, write_pair

pytestmark = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning", "ignore:'set_vital' is deprecated:UserWarning"
)

PACKINGS = {
    "concat": {"pad_id": -1},
    "best_fit": {"pad_id": -1, "strategy": "best_fit", "buffer_size": 7},
}
ALL_TOKENS = np.sort(np.concatenate(DOCS)).astype(np.int32)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """:data:`DOCS` (60 documents of 1 to 40 tokens) as one int32 Megatron pair."""
    return write_pair(tmp_path_factory.mktemp("tokens"), dtype=np.int32)


def packed(prefix: str, strategy: str, seq_len: int = 16, **source: Any) -> shardkit.Pipeline:
    return shardkit.TokenDataset(prefix, shuffle=True, seed=4, **source).pack(seq_len, **PACKINGS[strategy])


def crop(sample: dict[str, Any]) -> dict[str, Any]:
    """A random crop seeded by the record (``record_seed``): the same document each time it is read."""
    tokens = np.asarray(sample["input_ids"])
    keep = int(np.random.default_rng(shardkit.record_seed()).integers(1, len(tokens) + 1))
    return {"input_ids": tokens[:keep]}


def mapped(strategy: str, seq_len: int = 16) -> shardkit.Pipeline:
    """:data:`DOCS` as a map-style list, shuffled, cropped by a seeded map, through a shuffle buffer, packed."""
    docs = [{"input_ids": doc} for doc in DOCS]
    pipeline = shardkit.wrap(docs, shuffle=True, seed=2).map(crop).shuffle(5)
    return pipeline.pack(seq_len, **PACKINGS[strategy])


def rows(blocks: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [row.tolist() for b in blocks for row in b["input_ids"].reshape(-1, b["input_ids"].shape[-1])]


def saved_after(pipeline: shardkit.Pipeline, steps: int) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """(blocks before, the state through JSON, blocks after) of one uninterrupted run."""
    iterator = iter(pipeline)
    before = [next(iterator) for _ in range(steps)]
    state = json.loads(json.dumps(pipeline.state_dict()))
    return before, state, list(iterator)


def held(state: dict[str, Any]) -> tuple[int, int]:
    """(pieces held as data, pieces held by position) of a pack node."""
    return len(state["pieces"]), len(decode_positions(state["positions"], "test")) if "positions" in state else 0


def saved_bytes(state: Any) -> int:
    out = io.BytesIO()
    torch.save(state, out)  # as a trainer's checkpoint holds it
    return len(out.getvalue())


# -- exact resume ---------------------------------------------------------------------------


@settings(max_examples=examples(60), deadline=None)
@given(
    strategy=st.sampled_from(sorted(PACKINGS)),
    seq_len=st.sampled_from([5, 16, 33]),
    cut=st.floats(0, 1),
    source=st.sampled_from(["tokens", "mapped"]),
)
def test_packed_blocks_after_a_resume_at_any_cut_equal_the_uninterrupted_run_token_for_token(
    prefix: str, strategy: str, seq_len: int, cut: float, source: str
) -> None:
    def make() -> shardkit.Pipeline:
        return packed(prefix, strategy, seq_len) if source == "tokens" else mapped(strategy, seq_len)

    full = rows(list(make()))
    steps = int(cut * len(full))
    before, state, after = saved_after(make(), steps)
    as_data, by_position = held(state)
    assert as_data == 0, "every piece is saved by position"
    resumed = make()
    resumed.load_state_dict(state)
    assert rows(before) + rows(list(resumed)) == full and rows(after) == full[steps:]


@pytest.mark.parametrize("strategy", sorted(PACKINGS))
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stateful_dataloader_resumes_packed_token_blocks_exactly(prefix: str, strategy: str, workers: int) -> None:
    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(packed(prefix, strategy), batch_size=2, num_workers=workers)

    full = [rows([batch]) for batch in loader()]
    first, delivered = loader(), []
    for batch in first:
        delivered.append(rows([batch]))
        if len(delivered) == len(full) // 3:
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert '"positions"' in json.dumps(state) and '"pieces": [[' not in json.dumps(state)
    fresh = loader()
    fresh.load_state_dict(state)
    assert delivered + [rows([batch]) for batch in fresh] == full


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(PACKINGS))
def test_a_mixed_loader_of_two_workers_resumes_packed_token_blocks_exactly(prefix: str, strategy: str) -> None:
    def loader() -> shardkit.MixedLoader:
        return shardkit.MixedLoader(packed(prefix, strategy), 4, num_workers=2, micro_batch_size=2)

    full = [rows([batch]) for batch in loader()]
    first, delivered = loader(), []
    for batch in first:
        delivered.append(rows([batch]))
        if len(delivered) == len(full) // 2:
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert all(held(worker)[0] == 0 for worker in state["workers"]), "no piece saved as data"
    assert any(held(worker)[1] for worker in state["workers"]), "pieces held by position"
    fresh = loader()
    fresh.load_state_dict(state)
    assert delivered + [rows([batch]) for batch in fresh] == full


# -- faults ---------------------------------------------------------------------------------


def test_a_token_file_replaced_between_save_and_resume_is_refused_naming_it(tmp_path: Path) -> None:
    """Before: the unpacked tokens were in the state, and the rest came from the replaced file unnoticed."""
    prefix = write_pair(tmp_path, dtype=np.int32)
    _, state, _ = saved_after(packed(prefix, "best_fit"), 3)
    assert held(state)[1], "pieces held by position"
    other = [doc[::-1].copy() for doc in DOCS]  # same lengths, so the same counts and .idx sizes
    os.replace(write_pair(tmp_path, other, name="y", dtype=np.int32) + ".bin", prefix + ".bin")
    resumed = packed(prefix, "best_fit")
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match=r"shard 0 \(.*x\.bin\) is not the file it was when the state was saved"):
        list(resumed)


def test_an_unchanged_token_file_resumes_after_the_identity_check(tmp_path: Path) -> None:
    prefix = write_pair(tmp_path, dtype=np.int32)
    before, state, after = saved_after(packed(prefix, "concat"), 3)
    resumed = packed(prefix, "concat")
    resumed.load_state_dict(state)
    assert rows(list(resumed)) == rows(after)


def test_a_document_shorter_than_a_held_piece_starts_is_refused_naming_the_record(tmp_path: Path) -> None:
    """A state edited (or a file replaced where no identity is known) to start a piece past its document's end."""
    _, state, _ = saved_after(mapped("concat"), 2)
    state["starts"] = encode(np.full(held(state)[1], 10_000, np.uint16))
    resumed = mapped("concat")
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match=r"record \d+ of shard \d+ from token 10000 on, but read again it has"):
        list(resumed)


# -- elastic: a global state of both forms ----------------------------------------------------


def as_data(state: dict[str, Any], dtype: Any = np.int32) -> dict[str, Any]:
    """A rank's pack node with its pieces held as data (as a shardkit before positions saved them), cut from DOCS."""
    pieces = []
    for position, start in zip(decode_positions(state["positions"], "test").tolist(), starts(state)):
        tokens = DOCS[position & 0xFFFFFFFF].astype(dtype)
        stop = len(tokens) if state["strategy"] == "concat" else start + state["seq_len"]
        pieces.append([encode(tokens[start:stop]), start])
    rest = {k: v for k, v in state.items() if k not in ("positions", "starts", "identities")}
    return {**rest, "pieces": pieces}


def starts(state: dict[str, Any]) -> list[int]:
    return shardkit.state.decode(state["starts"]).tolist()


@pytest.mark.parametrize("strategy", sorted(PACKINGS))
def test_ranks_holding_pieces_as_data_and_by_position_gather_into_a_state_that_resumes_every_token_once(
    prefix: str, strategy: str
) -> None:
    delivered, states = [], []
    for rank in range(2):
        pipeline = packed(prefix, strategy, rank=rank, world_size=2, balance="none")
        iterator = iter(pipeline)
        delivered += [next(iterator) for _ in range(4)]
        states.append(json.loads(json.dumps(pipeline.state_dict())))
    assert held(states[1])[1], "rank 1 holds pieces to give as data"
    states[1] = as_data(states[1])
    merged = merge_ranks(states)
    assert merged["pieces"] and merged["positions"], "both forms in one global node"
    for world_size in (1, 3):
        rest = []
        for rank in range(world_size):
            pipeline = packed(prefix, strategy, rank=rank, world_size=world_size, balance="none")
            pipeline.load_state_dict(merged)
            rest += list(pipeline)
        tokens = np.concatenate([b["input_ids"].numpy() for b in delivered + rest])
        assert np.array_equal(np.sort(tokens[tokens != -1]), ALL_TOKENS), f"every token once on {world_size} ranks"


# -- sizes (issue 39's bounds; sizes, not timings) ---------------------------------------------


def long_documents(folder: Path, length: int) -> str:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, length, dtype=np.int32) for _ in range(12)]
    return write_pair(folder, docs, name=f"len{length}", dtype=np.int32)


def test_a_packed_token_state_is_under_4_kb_whatever_the_documents_length(tmp_path: Path) -> None:
    """Before: the rest of the document cut at the block's end was in the state (up to 190 KB for these)."""
    sizes = []
    for length in (3000, 47_000):
        pipeline = shardkit.TokenDataset(long_documents(tmp_path, length)).pack(2048)
        iterator = iter(pipeline)
        for _ in range(5):
            next(iterator)
        state = pipeline.state_dict()
        assert held(state) == (0, 1)
        sizes.append(saved_bytes(state))
    assert sizes[0] == sizes[1] <= 4096


def test_best_fit_over_records_adds_at_most_16_bytes_a_held_piece_to_a_position_only_state() -> None:
    """Before: 256 documents of ~400 int32 tokens each in the state (about 1 MB)."""
    rng = np.random.default_rng(3)
    docs = [{"input_ids": rng.integers(0, 50_000, int(n), dtype=np.int32)} for n in rng.integers(1, 2000, 3000)]
    pipeline = shardkit.wrap(docs, shuffle=True, seed=1).pack(2048, strategy="best_fit")
    iterator = iter(pipeline)
    for _ in range(200):
        next(iterator)
    state = pipeline.state_dict()
    pieces = held(state)[1]
    assert held(state)[0] == 0 and pieces >= 200
    base = {k: v for k, v in state.items() if k not in ("positions", "starts", "identities")}
    assert len(pickle.dumps(base)) <= 4096
    assert len(pickle.dumps(state)) - len(pickle.dumps(base)) <= 16 * pieces
