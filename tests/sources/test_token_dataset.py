"""TokenDataset: Megatron pairs get every guarantee of the other datasets — every document once over
ranks and DataLoader workers, seeded shuffles, exact resume, counts without a scan, remote reads
with the .idx fetched once."""

from __future__ import annotations

import collections
import json
import os

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit.formats.megatron import MegatronFormat
from tests.helpers.fault_server import FaultServer
from tests.helpers.reading import assert_split
from tests.helpers.tokens import DOCS, first_token, read_tokens, write_pair


def _pairs(tmp_path) -> list[str]:
    """Three pairs of 25, 20 and 15 documents (numbered 0..59 across them)."""
    return [write_pair(tmp_path, DOCS[a:b], name=f"p{i}") for i, (a, b) in enumerate([(0, 25), (25, 45), (45, 60)])]


def _ids(dataset: shardkit.TokenDataset, workers: int) -> list[int]:
    kwargs = {"multiprocessing_context": "fork"} if workers else {}
    return list(DataLoader(dataset.map(first_token), batch_size=None, num_workers=workers, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["none", "pad"])
def test_every_document_exactly_once_over_two_ranks_of_two_workers(tmp_path, balance) -> None:
    prefixes = _pairs(tmp_path)
    ranks = []
    for rank in range(2):
        dataset = shardkit.TokenDataset(prefixes, shuffle=True, seed=3, balance=balance, rank=rank, world_size=2)
        ranks.append([[str(i)] for i in _ids(dataset, workers=2)])  # one-document batches
    assert_split(ranks, [str(i) for i in range(len(DOCS))], balance)
    if balance == "none":
        seen = collections.Counter(b[0] for r in ranks for b in r)
        assert set(seen.values()) == {1}


def _gloo_rank_reads(rank: int, world_size: int, prefixes: list[str], out: str) -> None:
    """One gloo rank: TokenDataset (rank from the process group) through 2 spawned workers, a
    collective per batch as DDP's all-reduce; rank 0 writes every rank's (batches, ids) to ``out``."""
    import torch
    import torch.distributed as dist

    dataset = shardkit.TokenDataset(prefixes, shuffle=True, seed=9, balance="pad").map(first_token)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    ids, batches = [], 0
    for batch in loader:
        ids += batch.tolist()
        batches += 1
        dist.all_reduce(torch.ones(1))  # unequal batch counts would hang here
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (batches, ids))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


@pytest.mark.slow
def test_gloo_ranks_with_spawned_workers_read_every_document_in_equal_batches(tmp_path) -> None:
    from tests.helpers.processes import gloo_ranks

    prefixes = _pairs(tmp_path)
    out = str(tmp_path / "seen.json")
    gloo_ranks(_gloo_rank_reads, 2, prefixes, out, start_method="fork")
    with open(out) as f:
        (batches0, ids0), (batches1, ids1) = json.load(f)
    assert batches0 == batches1 and sorted(ids0 + ids1) == list(range(len(DOCS)))


def test_paths_are_taken_as_megatron_takes_them(tmp_path) -> None:
    prefixes = _pairs(tmp_path)
    every = list(range(len(DOCS)))
    for paths in (prefixes, [p + ".bin" for p in prefixes], [p + ".idx" for p in prefixes], f"{tmp_path}/*",
                  f"{tmp_path}/p*.bin"):  # fmt: skip
        assert _ids(shardkit.TokenDataset(paths), workers=0) == every, paths
    assert _ids(shardkit.TokenDataset(prefixes[1]), workers=0) == every[25:45]


def test_a_shuffle_is_a_function_of_the_seed(tmp_path) -> None:
    prefixes = _pairs(tmp_path)
    orders = [_ids(shardkit.TokenDataset(prefixes, shuffle=True, seed=seed), workers=0) for seed in (1, 1, 2)]
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == list(range(len(DOCS))) and orders[0] != sorted(orders[0])


def test_counts_come_from_the_idx_headers_without_reading_a_document(tmp_path, monkeypatch) -> None:
    prefixes = _pairs(tmp_path)

    def no_reading(*args, **kwargs):
        raise AssertionError("a document was read to count")

    monkeypatch.setattr(MegatronFormat, "_documents", no_reading)
    assert len(shardkit.TokenDataset(prefixes)) == len(DOCS)
    assert len(shardkit.TokenDataset(prefixes, rank=1, world_size=2, balance="drop")) == len(DOCS) // 2


def test_a_state_saved_mid_epoch_resumes_a_fresh_dataset_with_exactly_the_rest(tmp_path) -> None:
    prefixes = _pairs(tmp_path)

    def dataset() -> shardkit.TokenDataset:
        return shardkit.TokenDataset(prefixes, shuffle=True, seed=7, rank=0, world_size=2)

    whole = [first_token(r) for r in dataset()]
    interrupted = dataset()
    iterator = iter(interrupted)
    delivered = [first_token(next(iterator)) for _ in range(13)]
    state = json.loads(json.dumps(interrupted.state_dict()))  # plain data
    fresh = dataset()
    fresh.load_state_dict(state)
    assert delivered + [first_token(r) for r in fresh] == whole


@pytest.mark.slow
def test_a_stateful_dataloader_with_two_workers_resumes_mid_epoch_exactly(tmp_path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    prefixes = _pairs(tmp_path)

    def loader() -> StatefulDataLoader:
        source = shardkit.TokenDataset(prefixes, shuffle=True, seed=5).map(first_token)
        return StatefulDataLoader(source, batch_size=None, num_workers=2, multiprocessing_context="fork")

    first = loader()
    delivered, state = [], None
    for n, doc in enumerate(first, 1):
        delivered.append(int(doc))
        if n == 23:
            state = first.state_dict()
            break
    whole = [int(d) for d in loader()]
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [int(d) for d in resumed]
    assert sorted(delivered + rest) == list(range(len(DOCS))) and delivered == whole[:23]


def test_remote_pairs_read_the_same_documents_with_each_idx_fetched_once(tmp_path) -> None:
    pytest.importorskip("aiohttp")
    prefixes = _pairs(tmp_path)
    with FaultServer(str(tmp_path)) as server:
        urls = [f"{server.url}/{os.path.basename(p)}.bin" for p in prefixes]
        remote = shardkit.TokenDataset(urls, shuffle=True, seed=2)
        local = shardkit.TokenDataset(prefixes, shuffle=True, seed=2)
        expected = [t.tolist() for t in read_tokens(local)]
        assert [t.tolist() for t in read_tokens(remote)] == expected
        fetched = len(server.gets("p0.idx"))
        again = [t.tolist() for t in read_tokens(local)]  # a second epoch: shuffled anew
        assert [t.tolist() for t in read_tokens(remote)] == again
        assert len(server.gets("p0.idx")) == fetched  # the .idx of a pair is fetched once per process
        assert all(r.start >= 0 for r in server.gets("p0.bin")) and server.gets("p0.bin")  # ranged reads


def test_a_bad_document_under_skip_costs_itself_alone_and_ranks_stay_equal(tmp_path) -> None:
    prefix = write_pair(tmp_path)
    with open(prefix + ".idx", "r+b") as f:  # document 30's only sequence: a negative length
        f.seek(34 + 4 * 30)
        f.write((-1).to_bytes(4, "little", signed=True))
    counts = []
    with pytest.warns(UserWarning, match="skipping record 30"):
        for rank in range(2):
            dataset = shardkit.TokenDataset(prefix, on_error="skip", balance="pad", rank=rank, world_size=2)
            counts.append(len(list(dataset)))
    assert counts == [30, 30]  # made up for what was lost, so DDP does not hang
