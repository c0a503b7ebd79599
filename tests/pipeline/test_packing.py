"""``.pack()``: documents into blocks of ``seq_len`` tokens, every token exactly once, resumable.

Documents here hold consecutive token ids (document ``i`` is the run of ids
after document ``i - 1``'s), so the token stream of a dataset is
``arange(total)`` and every check of "exactly once" is an array comparison.
"""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

import shardkit
from shardkit import MixedLoader
from shardkit.pipeline import Pack, PackError, Pipeline, PipelineError, UnknownLengthError
from shardkit.state import StateError, merge, merge_ranks
from tests.helpers.examples import examples

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

ROOT = Path(__file__).resolve().parents[2]

#: The optional rows the checks of positions and documents read.
IDS = {"position_ids": True, "document_ids": True}


def documents(lengths: list[int] | np.ndarray, dtype: Any = np.int64) -> list[dict[str, Any]]:
    """Samples whose ``input_ids`` are consecutive runs of ids: all together, ``arange(sum(lengths))``."""
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return [{"input_ids": np.arange(a, b, dtype=dtype), "id": i} for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def lognormal_lengths(count: int, seed: int = 0) -> np.ndarray:
    """Document lengths as web text has them: lognormal, median 400 tokens."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(400), 1.0, count).astype(np.int64))


def real_tokens(blocks: list[dict[str, torch.Tensor]]) -> np.ndarray:
    """The tokens of ``blocks`` that are not padding, block after block."""
    if not blocks:
        return np.zeros(0, np.int64)
    return np.concatenate([b["input_ids"][b["document_ids"] >= 0].numpy() for b in blocks])


def segments(block: dict[str, torch.Tensor]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(tokens, positions)`` of each document of a block, in document_ids order."""
    documents_ = block["document_ids"].numpy()
    count = int(documents_.max()) + 1 if (documents_ >= 0).any() else 0
    return [
        (block["input_ids"].numpy()[documents_ == d], block["position_ids"].numpy()[documents_ == d])
        for d in range(count)
    ]


# -- concat ----------------------------------------------------------------------------


@settings(max_examples=examples(50), deadline=None)
@given(lengths=st.lists(st.integers(0, 300), max_size=40), seq_len=st.integers(1, 97))
def test_concat_reproduces_the_token_stream_exactly_with_positions_restarting_at_each_document(lengths, seq_len):
    blocks = list(shardkit.wrap(documents(lengths)).pack(seq_len, **IDS))
    total = sum(lengths)
    assert len(blocks) == -(-total // seq_len)
    assert np.array_equal(real_tokens(blocks), np.arange(total))
    expected_positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(0, np.int64)])
    got_positions = np.concatenate([b["position_ids"][b["document_ids"] >= 0].numpy() for b in blocks] or [[]])
    assert np.array_equal(got_positions, expected_positions)
    for index, block in enumerate(blocks):
        assert all(t.dtype == torch.int64 and t.shape == (seq_len,) for t in block.values())
        pad = block["document_ids"] < 0
        if index < len(blocks) - 1:
            assert not pad.any(), "only the last block is padded"
        assert torch.equal(block["input_ids"][pad], torch.zeros(int(pad.sum()), dtype=torch.int64))
        assert torch.equal(block["position_ids"][pad], torch.arange(int(pad.sum())))
        used = block["document_ids"][~pad].numpy()
        assert used[0] == 0 if len(used) else True
        # a new document index exactly where a document starts (position 0), never elsewhere
        assert np.array_equal(np.diff(used), (block["position_ids"][~pad].numpy()[1:] == 0).astype(np.int64))


@settings(max_examples=examples(200), deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 2**40)), max_size=6),
    room=st.integers(0, 20),
    dtype=st.sampled_from([np.int32, np.uint16, np.int64]),
    rows=st.booleans(),
)
def test_a_block_holds_its_pieces_tokens_then_padding_with_each_tokens_position_and_piece_index(
    pieces, room, dtype, rows
):
    """block() against the definition, token by token: one piece (copied alone) or several (concatenated),
    full or padded, pieces starting anywhere in their documents."""
    from shardkit.pipeline.blocks import block

    rng = np.random.default_rng(len(pieces))
    parts = [(rng.integers(0, 60_000, n).astype(np.uint16), start, -1) for n, start in pieces]
    seq_len = sum(n for n, _ in pieces) + room or 1
    got = block(parts, seq_len, 7, np.dtype(dtype), position_ids=rows, document_ids=rows)
    tokens, positions, index = [], [], []
    for i, (array, start, _) in enumerate(parts):
        for k, token in enumerate(array.tolist()):
            tokens.append(token), positions.append(start + k), index.append(i)
    padding = seq_len - len(tokens)
    assert got["input_ids"].numpy().dtype == dtype
    assert got["input_ids"].tolist() == tokens + [7] * padding
    assert set(got) == ({"input_ids", "position_ids", "document_ids"} if rows else {"input_ids"})
    if rows:
        assert got["position_ids"].dtype == got["document_ids"].dtype == torch.int64
        assert got["position_ids"].tolist() == positions + list(range(padding))
        assert got["document_ids"].tolist() == index + [-1] * padding


def test_concat_pads_with_pad_id_and_takes_lists_tensors_and_any_integer_dtype():
    lengths = [5, 6, 6]
    as_numpy = list(shardkit.wrap(documents(lengths, np.uint16)).pack(8, pad_id=-100, dtype=np.int64, **IDS))
    as_lists = list(
        shardkit.wrap([{"input_ids": d["input_ids"].tolist()} for d in documents(lengths)]).pack(8, pad_id=-100, **IDS)
    )
    as_tensors = list(
        shardkit.wrap([{"input_ids": torch.from_numpy(d["input_ids"])} for d in documents(lengths)]).pack(
            8, pad_id=-100, dtype=torch.int64, **IDS
        )
    )
    for other in (as_lists, as_tensors):
        assert all(torch.equal(a[k], b[k]) for a, b in zip(as_numpy, other) for k in a)
    assert as_numpy[-1]["input_ids"].tolist() == [16, -100, -100, -100, -100, -100, -100, -100]
    assert as_numpy[-1]["document_ids"].tolist() == [0, -1, -1, -1, -1, -1, -1, -1]
    assert as_numpy[1]["position_ids"].tolist() == [3, 4, 5, 0, 1, 2, 3, 4]  # doc 1 goes on, doc 2 starts at 0
    assert as_numpy[1]["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert as_numpy[2]["position_ids"].tolist() == [5, 0, 1, 2, 3, 4, 5, 6]  # the padding counts from 0


@pytest.mark.parametrize("form", ["data", "positions"])
def test_read_only_memory_mapped_documents_pack_and_their_unpacked_rest_saves_in_the_state(tmp_path, form):
    path = tmp_path / "tokens.bin"
    np.arange(300, dtype=np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    docs = [{"input_ids": tokens[a:b]} for a, b in [(0, 70), (70, 75), (75, 300)]]  # as a token file's reader yields
    source = (lambda: shardkit.wrap(Plain(docs))) if form == "data" else (lambda: shardkit.wrap(docs))
    for strategy in STRATEGY_ARGS:
        full = list(source().pack(64, **STRATEGY_ARGS[strategy]))
        assert np.array_equal(np.sort(real_tokens(full)), np.arange(300))
        pipeline = source().pack(64, **STRATEGY_ARGS[strategy])
        iterator = iter(pipeline)
        next(iterator)
        state = json.loads(json.dumps(pipeline.state_dict()))
        if form == "data":
            assert state["pieces"] and state["pieces"][0][0][1] == "<u2", "saved in the dtype it was read in"
        else:
            assert not state["pieces"] and state["positions"], "saved as the documents' positions"
        fresh = source().pack(64, **STRATEGY_ARGS[strategy])
        fresh.load_state_dict(state)
        assert same_blocks(list(fresh), full[1:]), strategy


def test_token_list_columns_of_jsonl_and_parquet_files_pack_to_the_same_blocks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"input_ids": d["input_ids"].tolist()} for d in documents([40, 7, 90, 3, 55])]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "docs.parquet")
    expected = list(shardkit.wrap(rows).pack(32, **IDS))
    for dataset in (
        shardkit.JsonlDataset(str(tmp_path / "docs.jsonl")),
        shardkit.ParquetDataset(str(tmp_path / "docs.parquet")),
    ):
        assert same_blocks(list(dataset.pack(32, **IDS)), expected), dataset


# -- best_fit --------------------------------------------------------------------------


@settings(max_examples=examples(80), deadline=None)
@given(
    lengths=st.lists(st.integers(0, 200), max_size=40),
    seq_len=st.integers(1, 64),
    buffer_size=st.integers(1, 12),
)
def test_best_fit_keeps_every_document_whole_unless_longer_than_a_block_and_packs_every_token_once(
    lengths, seq_len, buffer_size
):
    docs = documents(lengths)
    blocks = list(shardkit.wrap(docs).pack(seq_len, strategy="best_fit", buffer_size=buffer_size, **IDS))
    starts = {int(d["input_ids"][0]): len(d["input_ids"]) for d in docs if len(d["input_ids"])}
    seen = []
    for block in blocks:
        assert (block["document_ids"] >= 0).any(), "no empty block"
        for tokens, positions in segments(block):
            first = int(tokens[0]) - int(positions[0])  # the document's first token id
            length = starts[first]
            assert positions[0] % seq_len == 0, "a document is cut only at multiples of seq_len"
            assert len(tokens) == min(seq_len, length - positions[0]), "whole, or a full seq_len piece, or the rest"
            assert np.array_equal(tokens, np.arange(first + positions[0], first + positions[0] + len(tokens)))
            assert np.array_equal(positions, np.arange(positions[0], positions[0] + len(tokens)))
            seen.append(tokens)
        used = int((block["document_ids"] >= 0).sum())
        assert (block["document_ids"][used:] == -1).all() and (block["document_ids"][:used] >= 0).all()
    everything = np.sort(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
    assert np.array_equal(everything, np.arange(sum(lengths)))


def test_best_fit_fills_blocks_of_2048_to_99_percent_on_lognormal_documents():
    lengths = lognormal_lengths(3000)
    blocks = list(shardkit.wrap(documents(lengths, np.int32)).pack(2048, strategy="best_fit", **IDS))
    fill = lengths.sum() / (len(blocks) * 2048)
    assert fill >= 0.99, fill
    assert np.array_equal(np.sort(real_tokens(blocks)), np.arange(lengths.sum()))


# -- what it refuses ---------------------------------------------------------------------


def test_a_sample_without_the_key_is_an_error_naming_the_key():
    with pytest.raises(PackError, match=r"pack\(key='tokens'\) got a sample with keys \['id', 'input_ids'\]"):
        list(shardkit.wrap(documents([4, 4])).pack(8, key="tokens"))
    with pytest.raises(PackError, match="got a str sample, which has no 'input_ids'"):
        list(shardkit.wrap(["text"]).pack(8))
    with pytest.raises(PackError, match=r"'input_ids' must be a 1-D array of integer token ids.*float64"):
        list(shardkit.wrap([{"input_ids": np.ones(3)}]).pack(8))


def test_settings_that_cannot_work_are_refused_naming_the_argument():
    source = shardkit.wrap(documents([3]))
    with pytest.raises(PipelineError, match="pack.seq_len."):
        source.pack(0)
    with pytest.raises(PipelineError, match="strategy"):
        source.pack(8, strategy="first_fit")
    with pytest.raises(PipelineError, match="buffer_size. applies to strategy='best_fit' only"):
        source.pack(8, buffer_size=4)
    with pytest.raises(PipelineError, match="pack.buffer_size."):
        source.pack(8, strategy="best_fit", buffer_size=0)


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_blocks_keep_the_documents_dtype_byte_exact_and_hold_the_id_rows_only_when_asked(dtype, strategy):
    lengths = [5, 0, 13, 2, 9, 30, 1]
    docs = documents(lengths, dtype)
    plain = list(shardkit.wrap(docs).pack(8, strategy=strategy, pad_id=7))
    both = list(shardkit.wrap(docs).pack(8, strategy=strategy, pad_id=7, **IDS))
    assert all(list(b) == ["input_ids"] and b["input_ids"].numpy().dtype == dtype for b in plain)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(plain, both, strict=True))
    real = np.concatenate([b["input_ids"].numpy()[b["document_ids"].numpy() >= 0] for b in both])
    stream = np.concatenate([d["input_ids"] for d in docs])
    assert (real if strategy == "concat" else np.sort(real)).tobytes() == stream.tobytes()
    for name in IDS:
        one = list(shardkit.wrap(docs).pack(8, strategy=strategy, pad_id=7, **{name: True}))
        assert all(
            sorted(a) == sorted(["input_ids", name]) and torch.equal(a[name], b[name]) for a, b in zip(one, both)
        )
        assert all(a[name].dtype == torch.int64 for a in one)
    wide = list(shardkit.wrap(docs).pack(8, strategy=strategy, pad_id=7, dtype=torch.int64))
    assert all(torch.equal(a["input_ids"], b["input_ids"].long()) and a["input_ids"].dtype == torch.int64
               for a, b in zip(wide, both))  # fmt: skip


def test_a_token_the_blocks_dtype_cannot_hold_is_an_error_naming_dtype_never_a_wrap_round():
    small = {"input_ids": np.array([1, 2], np.uint16)}
    fits, big = {"input_ids": np.array([3, 65_535], np.int64)}, {"input_ids": np.array([4, 70_000], np.int32)}
    blocks = list(shardkit.wrap([small, fits]).pack(4))
    assert blocks[0]["input_ids"].dtype == torch.uint16 and blocks[0]["input_ids"].tolist() == [1, 2, 3, 65_535]
    with pytest.raises(
        PackError, match=r"token 70000 of a int32 document does not fit the blocks' dtype uint16.*dtype="
    ):
        list(shardkit.wrap([small, big]).pack(4))
    with pytest.raises(PackError, match=r"token -3 of a int64 document does not fit pack\(dtype=uint8\)"):
        list(shardkit.wrap([{"input_ids": [5, -3]}]).pack(4, dtype=np.uint8))
    with pytest.raises(PackError, match=r"pad_id=-100\) does not fit the documents' dtype uint16.*dtype=np.int64"):
        list(shardkit.wrap([small]).pack(4, pad_id=-100))
    source = shardkit.wrap([small])
    with pytest.raises(PipelineError, match=r"pack\(dtype\) must be an integer dtype.*float32"):
        source.pack(4, dtype=np.float32)
    with pytest.raises(PipelineError, match=r"pack\(pad_id=-1\) does not fit pack\(dtype=uint16\)"):
        source.pack(4, pad_id=-1, dtype=torch.uint16)
    with pytest.raises(PipelineError, match=r"pack\(position_ids\) must be True or False"):
        source.pack(4, position_ids="yes")  # pyright: ignore[reportArgumentType]


def test_packing_has_no_length_since_it_depends_on_the_token_counts():
    packed = shardkit.wrap(documents([3, 4])).pack(8)
    with pytest.raises(UnknownLengthError, match="pack"):
        len(packed)
    assert packed.reader_lengths(2) is None
    with pytest.raises(UnknownLengthError):
        len(packed.batch(2))


# -- resume --------------------------------------------------------------------------------

STRATEGY_ARGS = {"concat": {**IDS}, "best_fit": {"strategy": "best_fit", "buffer_size": 6, **IDS}}


def shuffled_documents(strategy: str, seq_len: int = 64) -> Pipeline:
    """120 documents of 0 to 150 tokens, shard-shuffled and through a shuffle buffer, then packed."""
    docs = documents(np.random.default_rng(1).integers(0, 150, 120))
    return shardkit.wrap(docs, shuffle=True, seed=3).shuffle(5).pack(seq_len, **STRATEGY_ARGS[strategy])


def ranked_documents(strategy: str, rank: int | None = None, world_size: int | None = None) -> Pipeline:
    """120 documents of 1 to 150 tokens over ``world_size`` ranks (None: the process group's), packed."""
    docs = documents(np.random.default_rng(2).integers(1, 150, 120))
    source = shardkit.wrap(docs, shuffle=True, seed=2, rank=rank, world_size=world_size)
    return source.pack(64, **STRATEGY_ARGS[strategy])


class Plain:
    """An iterable that is no more than that: records it yields cannot be read again, so a pack over it
    saves its pieces as data."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)


def plain_documents(strategy: str) -> Pipeline:
    """:func:`shuffled_documents` over a plain iterable (no shard shuffle): the pieces saved as data."""
    docs = documents(np.random.default_rng(1).integers(0, 150, 120))
    return shardkit.wrap(Plain(docs)).shuffle(5).pack(64, **STRATEGY_ARGS[strategy])


def same_blocks(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> bool:
    return len(got) == len(expected) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(got, expected)
    )


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_a_state_after_k_blocks_resumes_the_rest_exactly_in_a_fresh_pipeline(strategy):
    full = list(shuffled_documents(strategy))
    for k in (0, 1, 7, len(full) // 2, len(full) - 1, len(full)):
        pipeline = shuffled_documents(strategy)
        iterator = iter(pipeline)
        for _ in range(k):
            next(iterator)
        state = json.loads(json.dumps(pipeline.state_dict()))
        fresh = shuffled_documents(strategy)
        fresh.load_state_dict(state)
        assert same_blocks(list(fresh), full[k:]), f"resumed after {k} blocks"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_mixed_loader_with_two_workers_resumes_exactly_and_on_other_worker_counts_every_token_once(strategy):
    def loader(workers: int) -> MixedLoader:
        return MixedLoader(shuffled_documents(strategy, 32), 4, num_workers=workers, micro_batch_size=2)

    batches = list(loader(2))
    full = [batch["input_ids"] for batch in batches]
    first, saved = loader(2), None
    delivered = []
    for count, batch in enumerate(first, 1):
        delivered.append(batch)
        if count == len(full) // 2:
            saved = json.loads(json.dumps(first.state_dict()))
            assert '"positions"' in json.dumps(saved), "tokens held back, by their documents' positions"
            break
    same = loader(2)
    same.load_state_dict(saved)
    rest = [batch["input_ids"] for batch in same]
    assert all(torch.equal(a, b) for a, b in zip([b["input_ids"] for b in delivered] + rest, full))
    assert len(delivered) + len(rest) == len(full)
    everything = np.sort(real_tokens(batches))
    for workers in (1, 3):
        other = loader(workers)
        other.load_state_dict(saved)
        got = np.concatenate([real_tokens([b]) for b in delivered] + [real_tokens([b]) for b in other])
        assert np.array_equal(np.sort(got), everything), f"restored on {workers} workers"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_a_token_file_packed_on_two_ranks_of_two_workers_yields_every_token_once_in_its_dtype(strategy, tmp_path):
    from tests.helpers.tokens import DOCS, write_pair

    prefix = write_pair(tmp_path, dtype=np.int32)
    seen = []
    for rank in (0, 1):
        dataset = shardkit.TokenDataset(prefix, rank=rank, world_size=2, balance="none", shuffle=True)
        blocks = dataset.pack(16, strategy=strategy, pad_id=-1)
        for batch in MixedLoader(blocks, batch_size=4, num_workers=2):
            assert batch["input_ids"].dtype == torch.int32 and list(batch) == ["input_ids"]
            seen.append(batch["input_ids"].numpy().ravel())
    tokens = np.concatenate(seen)
    assert np.array_equal(np.sort(tokens[tokens != -1]), np.sort(np.concatenate(DOCS)).astype(np.int32))


@pytest.mark.slow
def test_stateful_dataloader_with_two_workers_resumes_packed_blocks_exactly():
    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(shuffled_documents("best_fit", 32), batch_size=3, num_workers=2)

    full = [batch["input_ids"] for batch in loader()]
    first = loader()
    delivered = []
    for batch in first:
        delivered.append(batch["input_ids"])
        if len(delivered) == 5:
            break
    state = first.state_dict()
    fresh = loader()
    fresh.load_state_dict(state)
    got = delivered + [batch["input_ids"] for batch in fresh]
    assert len(got) == len(full) and all(torch.equal(a, b) for a, b in zip(got, full))


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_the_states_of_two_ranks_gather_into_one_that_resumes_on_one_or_three_ranks_every_token_once(strategy):
    delivered, states = [], []
    for rank in range(2):
        pipeline = ranked_documents(strategy, rank, 2)
        iterator = iter(pipeline)
        delivered += [next(iterator) for _ in range(9)]
        states.append(json.loads(json.dumps(pipeline.state_dict())))
    merged = merge_ranks(states)
    assert merged["ranks"] == 2 and merged["positions"], "the ranks' unpacked tokens travel in the global state"
    assert merge([merged]) == merged, "a global state saved again before iterating stays global"
    with pytest.raises(StateError, match=r"cannot merge a global pack state \(from merge_ranks\) with other workers"):
        merge([{**merged, "share": None}, {**states[0], "share": None}])
    with pytest.raises(StateError, match="already global"):
        merge_ranks([merged, merged])
    total = sum(len(d["input_ids"]) for d in documents(np.random.default_rng(2).integers(1, 150, 120)))
    for world_size in (1, 3):
        rest = []
        for rank in range(world_size):
            pipeline = ranked_documents(strategy, rank, world_size)
            pipeline.load_state_dict(merged)
            rest += list(pipeline)
        got = real_tokens(delivered + rest)
        assert np.array_equal(np.unique(got), np.arange(total)), f"nothing lost resuming on {world_size} ranks"
        # "pad" makes the new ranks' document counts equal with fewer than world_size repeated documents
        assert len(got) - total < world_size * 150, f"only pad repeats resuming on {world_size} ranks"


def _save_after_three_batches_and_gather(rank: int, world_size: int, strategy: str, out_dir: str) -> None:
    loader = MixedLoader(ranked_documents(strategy), 4, num_workers=2, micro_batch_size=2)
    # A state with every micro-batch, so the saved state is the packers' alone (no micro-batches carried):
    # this checks the pack stage's merge over ranks, resumed below at the pipeline level.
    loader._micro_batches.state_every = 1  # type: ignore[union-attr]
    delivered = []
    for count, batch in enumerate(loader, 1):
        delivered += real_tokens([batch]).tolist()
        if count == 3:
            break
    gathered = shardkit.state.gather(loader.state_dict())  # the global MixedLoader state
    assert gathered["kind"] == "mixed_loader" and not gathered["carry"], "batches of whole micro-batches"
    with open(Path(out_dir) / f"{rank}.json", "w") as file:
        json.dump({"delivered": delivered, "state": gathered}, file)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_two_gloo_ranks_of_two_workers_gather_a_state_that_resumes_on_one_and_three_ranks(strategy, tmp_path):
    from tests.helpers.processes import gloo_ranks

    gloo_ranks(_save_after_three_batches_and_gather, 2, strategy, str(tmp_path), start_method="fork")
    saved = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert saved[0]["state"] == saved[1]["state"], "every rank gathers the same global state"
    dataset_state = saved[0]["state"]["workers"][0]  # the global state of the pipeline
    assert dataset_state["ranks"] == 2 and dataset_state["positions"]
    delivered = np.array(saved[0]["delivered"] + saved[1]["delivered"], np.int64)
    total = int(np.random.default_rng(2).integers(1, 150, 120).sum())
    for world_size in (1, 3):
        rest = []
        for rank in range(world_size):
            pipeline = ranked_documents(strategy, rank, world_size)
            pipeline.load_state_dict(dataset_state)
            rest += list(pipeline)
        got = np.concatenate([delivered, real_tokens(rest)])
        assert np.array_equal(np.unique(got), np.arange(total)), f"nothing lost resuming on {world_size} ranks"
        assert len(got) - total < world_size * 150, f"only pad repeats resuming on {world_size} ranks"


# -- malformed states -----------------------------------------------------------------------


def _state(strategy: str = "best_fit", form: str = "data") -> dict[str, Any]:
    pipeline = plain_documents(strategy) if form == "data" else shuffled_documents(strategy)
    iterator = iter(pipeline)
    next(iterator)
    return json.loads(json.dumps(pipeline.state_dict()))


def _float_piece(state: dict[str, Any]) -> None:
    state["pieces"][0][0] = shardkit.state.encode(np.ones(3))


def _long_piece(state: dict[str, Any]) -> None:
    state["pieces"][0][0] = shardkit.state.encode(np.arange(65))


BAD_STATES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "pieces missing": (lambda s: s.pop("pieces"), r"has no 'pieces'"),
    "pieces not a list": (lambda s: s.update(pieces={}), r"state\['pieces'\] must be list or tuple"),
    "piece not a pair": (lambda s: s["pieces"].__setitem__(0, [1]), r"state\['pieces'\]\[0\] must be \[encoded"),
    "negative first position": (lambda s: s["pieces"][0].__setitem__(1, -1), r"state\['pieces'\]\[0\]"),
    "piece of floats": (_float_piece, r"state\['pieces'\]\[0\] must hold a non-empty 1-D integer"),
    "piece not decodable": (lambda s: s["pieces"][0].__setitem__(0, ["ndarray", "<i8"]), r"state\['pieces'\]\[0\]"),
    "piece longer than a block": (_long_piece, r"state\['pieces'\]\[0\] holds 65 tokens, more than seq_len 64"),
    "unknown strategy": (lambda s: s.update(strategy="greedy"), r"state\['strategy'\] must be one of"),
    "other strategy": (lambda s: s.update(strategy="concat"), r"saved with strategy 'concat'"),
    "other seq_len": (lambda s: s.update(seq_len=32), r"saved with seq_len 32"),
    "seq_len zero": (lambda s: s.update(seq_len=0), r"state\['seq_len'\] must be >= 1"),
    "ranks zero": (lambda s: s.update(ranks=0), r"state\['ranks'\] must be None or >= 1"),
    "global with a share": (lambda s: s.update(ranks=2, share=[0, 2]), r"must have share None"),
}

BAD_POSITION_STATES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "starts missing": (lambda s: s.pop("starts"), r"needs all of \['positions', 'starts', 'identities'\]"),
    "starts of another length": (
        lambda s: s.update(starts=shardkit.state.encode(np.zeros(1000, np.uint8))),
        r"state\['starts'\] must be a 1-D unsigned array of one start per position",
    ),
    "signed starts": (
        lambda s: s.update(starts=shardkit.state.encode(-np.ones(len(_positions(s)), np.int64))),
        r"state\['starts'\] must be a 1-D unsigned array",
    ),
    "starts past 2**62": (
        lambda s: s.update(starts=shardkit.state.encode(np.full(len(_positions(s)), 2**63, np.uint64))),
        r"state\['starts'\] holds a start past",
    ),
    "positions not decodable": (lambda s: s.update(positions=["ndarray"]), r"state\['positions'\] is not an encoded"),
    "identities not paired": (lambda s: s["identities"]["digests"].append("x"), r"identities must pair"),
}


def _positions(state: dict[str, Any]) -> np.ndarray:
    return shardkit.state.decode_positions(state["positions"], "test")


@pytest.mark.parametrize("name", list(BAD_STATES))
def test_a_malformed_pack_state_is_refused_naming_the_field(name):
    mutate, message = BAD_STATES[name]
    state = _state()
    assert state["pieces"], "the state holds pieces to corrupt"
    mutate(state)
    with pytest.raises(StateError, match=message):
        plain_documents("best_fit").load_state_dict(state)


@pytest.mark.parametrize("name", list(BAD_POSITION_STATES))
def test_a_malformed_pack_state_of_positions_is_refused_naming_the_field(name):
    mutate, message = BAD_POSITION_STATES[name]
    state = _state(form="positions")
    assert len(_positions(state)), "the state holds positions to corrupt"
    mutate(state)
    with pytest.raises(StateError, match=message):
        shuffled_documents("best_fit").load_state_dict(state)


def test_a_pack_state_loads_only_into_a_pack_stage():
    with pytest.raises(StateError, match="'pack' stage but this stage is 'shuffle'"):
        shardkit.wrap(documents([3])).shuffle(4).load_state_dict(_state())


# -- the attention-mask recipe of docs/pretraining.md -------------------------------------


def test_the_mask_recipe_of_the_docs_keeps_attention_within_documents():
    """Runs the page's script: it packs, builds both masks and asserts no attention crosses documents."""
    page = (ROOT / "docs" / "pretraining.md").read_text()
    scripts = re.findall(r'^```python title="packed_attention.py"\n(.*?)^```$', page, flags=re.MULTILINE | re.DOTALL)
    assert len(scripts) == 1
    module = types.ModuleType("packed_attention")  # a real module: torch.compile (in FlexAttention) looks it up
    sys.modules[module.__name__] = module
    try:
        exec(compile(scripts[0], "docs/pretraining.md:packed_attention.py", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def test_pack_is_a_pipeline_stage_that_shows_its_settings():
    packed = shardkit.wrap(documents([3])).pack(16, strategy="best_fit")
    assert isinstance(packed, Pack) and packed.buffer_size == Pack.DEFAULT_BUFFER
    assert repr(packed).endswith(".pack(16, key='input_ids', strategy='best_fit', buffer_size=256)")
    asked = shardkit.wrap(documents([3])).pack(16, document_ids=True, dtype=torch.int64)
    assert repr(asked).endswith(".pack(16, key='input_ids', strategy='concat', document_ids=True, dtype=int64)")
