"""Every rank's state in one checkpoint (issue 24): the ``"ranks"`` node, its checks, the
entry each rank takes, the global state of all entries, and StatefulDataLoader's length.

Ranks are simulated here by datasets built with an explicit ``rank``/``world_size``
and by calling the pure functions with a ``place``; the real gathering over gloo
ranks under torchrun is in ``test_ranks_torchrun.py``.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

import shardkit
from shardkit.ranks import check_ranks, own_or_global, ranks_node
from shardkit.state import StateError, merge_ranks
from tests.helpers.shards import all_ids, synthetic_read, synthetic_shards

COUNTS = [40, 40, 40, 31]  # 151 records: rank 0 reads 76, rank 1 75 (and one padded repeat)
TAKEN = 3  # batches delivered before the state is saved


def rank_source(rank: int, world_size: int, *, shuffle: bool = True) -> shardkit.Pipeline:
    source = shardkit.ShardedDataset(
        synthetic_shards(COUNTS), synthetic_read, shuffle=shuffle, rank=rank, world_size=world_size
    )
    return source.map(str.upper)


def mixed(rank: int, world_size: int = 2, **kwargs) -> shardkit.MixedLoader:
    return shardkit.MixedLoader(rank_source(rank, world_size), batch_size=8, collate_fn=list, **kwargs)


def flat(batches) -> list[str]:
    return [sample for batch in batches for sample in batch]


def saved_after(loader, batches: int = TAKEN) -> tuple[list[str], dict]:
    iterator = iter(loader)
    head = flat(next(iterator) for _ in range(batches))
    return head, loader.state_dict()


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list[list[str]], list[dict]]:
    """What each of 2 simulated ranks delivered before saving, and its state."""
    heads, states = zip(*(saved_after(mixed(rank)) for rank in range(2)))
    return list(heads), list(states)


def test_a_ranks_node_round_trips_through_json(two_ranks):
    _, states = two_ranks
    node = ranks_node(states)
    assert node["kind"] == "ranks" and node["world_size"] == 2 and node["version"] == shardkit.state.VERSION
    loaded = json.loads(json.dumps(node))
    assert check_ranks(loaded, "here") == json.loads(json.dumps(states))


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda node: node.pop("world_size"), "world_size"),
        (lambda node: node.update(world_size="2"), "world_size"),
        (lambda node: node.update(world_size=0), "world_size"),
        (lambda node: node.pop("states"), "states"),
        (lambda node: node.update(states={"0": {}}), "states"),
        (lambda node: node["states"].pop(), r"holds 1 states for world_size=2"),
        (lambda node: node["states"].__setitem__(1, [1, 2]), r"state\['states'\]\[1\] must be a dict"),
        (lambda node: node.update(version=99), "version 99"),
    ],
)
def test_a_malformed_ranks_node_is_a_state_error_naming_the_field(two_ranks, edit, named):
    node = json.loads(json.dumps(ranks_node(two_ranks[1])))
    edit(node)
    with pytest.raises(StateError, match=named):
        mixed(0).load_state_dict(node)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_takes_its_own_entry_and_resumes_its_own_remainder(two_ranks, rank):
    heads, states = two_ranks
    node = json.loads(json.dumps(ranks_node(states)))
    own = own_or_global(node, "here", merge_ranks, place=(rank, 2))
    assert own == node["states"][rank]
    resumed = mixed(rank)
    resumed.load_state_dict(own)
    uninterrupted = flat(mixed(rank))
    assert heads[rank] + flat(resumed) == uninterrupted


def test_a_loader_of_another_world_size_loads_the_global_state_of_all_entries():
    """2 ranks saved without a shuffle buffer; one process resumes every sample no rank delivered."""
    heads, states = zip(*(saved_after(mixed_unshuffled(rank, 2)) for rank in range(2)))
    node = json.loads(json.dumps(ranks_node(list(states))))
    merged = own_or_global(node, "here", merge_ranks, place=None)  # no process group: merged
    assert merged == merge_ranks(list(states))
    assert merged["kind"] == "mixed_loader" and merged["num_workers"] == 0  # global: loads on any world size


def test_a_mixed_loader_without_a_process_group_resumes_every_rank_from_the_global_state():
    heads, states = zip(*(saved_after(mixed_unshuffled(rank, 2)) for rank in range(2)))
    resumed = mixed_unshuffled(0, 1)
    resumed.load_state_dict(ranks_node(list(states)))
    rest = flat(resumed)
    delivered = [sample for head in heads for sample in head]
    assert not [s for s, n in Counter(delivered + rest).items() if n > 1], "a sample came twice"
    assert sorted(delivered + rest) == sorted(s.upper() for s in all_ids(synthetic_shards(COUNTS)))


def mixed_unshuffled(rank: int, world_size: int) -> shardkit.MixedLoader:
    # balance="none": nothing padded, so the samples over all ranks are each record once
    source = shardkit.ShardedDataset(
        synthetic_shards(COUNTS), synthetic_read, rank=rank, world_size=world_size, balance="none"
    ).map(str.upper)
    return shardkit.MixedLoader(source, batch_size=8, collate_fn=list)


def test_without_a_process_group_state_dict_is_the_rank_state_and_gather_false_changes_nothing():
    loader = mixed(0)
    _, state = saved_after(loader)
    assert state["kind"] == "mixed_loader" and loader.state_dict(gather=False) == state
    assert mixed(0, gather_states=False).gather_states is False
    with pytest.raises(shardkit.loader.LoaderError, match="gather_states must be a bool"):
        mixed(0, gather_states="yes")


# -- StatefulDataLoader -------------------------------------------------------------------


def stateful(source, **kwargs) -> shardkit.StatefulDataLoader:
    return shardkit.StatefulDataLoader(source, batch_size=8, num_workers=2, collate_fn=list, **kwargs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_stateful_dataloader_len_counts_every_workers_last_batch(drop_last):
    loader = stateful(rank_source(0, 1), drop_last=drop_last)  # 151 records: workers read 76 and 75
    assert len(loader) == len(list(loader)) == (18 if drop_last else 20)


def test_stateful_dataloader_of_another_world_size_resumes_the_global_state_exactly():
    def unshuffled(rank: int, world_size: int) -> shardkit.Pipeline:
        return shardkit.ShardedDataset(
            synthetic_shards(COUNTS), synthetic_read, rank=rank, world_size=world_size, balance="none"
        ).map(str.upper)

    heads, states = [], []
    for rank in range(2):
        loader = stateful(unshuffled(rank, 2))
        iterator = iter(loader)
        heads.append(flat(next(iterator) for _ in range(TAKEN)))
        states.append(loader.state_dict())
    resumed = stateful(unshuffled(0, 1))
    resumed.load_state_dict(json.loads(json.dumps(ranks_node(states))))
    rest = flat(resumed)
    delivered = heads[0] + heads[1]
    assert len(delivered) == 2 * TAKEN * 8 and not set(delivered) & set(rest)
    assert sorted(delivered + rest) == sorted(s.upper() for s in all_ids(synthetic_shards(COUNTS)))


def test_stateful_dataloader_takes_its_own_entry_of_a_ranks_node_on_the_same_world_size(monkeypatch):
    source = rank_source(1, 2)
    loader = stateful(source)
    iterator = iter(loader)
    head = flat(next(iterator) for _ in range(TAKEN))
    own = loader.state_dict()
    node = ranks_node([{"not": "rank 1's"}, json.loads(json.dumps(own))])
    monkeypatch.setattr("shardkit.ranks._place", lambda: (1, 2))
    resumed = stateful(rank_source(1, 2))
    resumed.load_state_dict(node)
    assert head + flat(resumed) == flat(stateful(rank_source(1, 2)))


def test_stateful_dataloader_is_generic_in_its_batch_type_as_torchdatas_is():
    # torchdata's test_dataloader.py::test_typing, with shardkit's class: "change only the import" holds.
    from typing import List, get_args, get_origin  # noqa: UP035  (typing.List is what that test subscripts with)

    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader

    alias = shardkit.StatefulDataLoader[List[torch.Tensor]]  # noqa: UP006
    assert get_origin(alias) is shardkit.StatefulDataLoader and get_args(alias) == (List[torch.Tensor],)  # noqa: UP006
    assert get_args(shardkit.StatefulDataLoader[list[torch.Tensor]]) == get_args(TorchdataLoader[list[torch.Tensor]])

    class Typed(shardkit.StatefulDataLoader[list[str]]):
        pass

    loader = Typed(rank_source(0, 1), batch_size=8, collate_fn=list)
    assert isinstance(loader, TorchdataLoader)
    assert sorted(flat(loader)) == sorted(s.upper() for s in all_ids(synthetic_shards(COUNTS)))


@pytest.mark.parametrize("persistent", [False, True])
def test_stateful_dataloader_saved_after_a_trainer_dropped_its_iterator_resumes_where_it_was(persistent):
    # Lightning's teardown when fit() ends: workers shut down, loader._iterator = None. A checkpoint saved
    # after it (trainer.save_checkpoint) held torchdata's state of a fresh iterator: the epoch began again.
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

    loader = stateful(rank_source(0, 1), persistent_workers=persistent)
    iterator = iter(loader)
    head = flat(next(iterator) for _ in range(TAKEN))
    _shutdown_workers_and_reset_iterator(loader)
    saved = json.loads(json.dumps(loader.state_dict()))
    assert saved == loader.state_dict()  # asked again, still the dropped iterator's position
    resumed = stateful(rank_source(0, 1), persistent_workers=persistent)
    resumed.load_state_dict(saved)
    rest = flat(resumed)
    assert head + rest == flat(stateful(rank_source(0, 1))) and len(rest) == sum(COUNTS) - TAKEN * 8
    assert len(flat(loader)) == sum(COUNTS)  # the next iteration of the loader itself is a whole epoch


def test_rank_0s_state_of_torchdatas_own_loader_loaded_on_rank_1_says_why_and_names_the_fix():
    from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader

    saving = TorchdataLoader(rank_source(0, 2), batch_size=8, num_workers=2, collate_fn=list)
    iterator = iter(saving)
    [next(iterator) for _ in range(TAKEN)]
    rank_0s = json.loads(json.dumps(saving.state_dict()))  # what a trainer writes: rank 0's alone
    loading = TorchdataLoader(rank_source(1, 2), batch_size=8, num_workers=2, collate_fn=list)
    loading.load_state_dict(rank_0s)
    with pytest.raises(StateError, match=r"saved with rank 0, but here it is 1: it holds rank 0's position") as info:
        list(loading)
    assert "Trainers save rank 0's checkpoint only" in str(info.value)
    assert "Fix: build the loader with shardkit.StatefulDataLoader" in str(info.value)
    assert "or shardkit.MixedLoader" in str(info.value)
