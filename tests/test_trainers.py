"""Correct inside the trainers people use (issue 16).

Fast tests: epochs count themselves when nobody calls ``set_epoch``; a
DataLoader never reports a ``len()`` that would cut an epoch short; Accelerate's
loader wrappers are refused. Slow tests: Lightning, Accelerate and the Hugging
Face Trainer on 2 CPU ranks (gloo) with every sample id each rank trained on,
per epoch, recorded by the examples, and the documented ways that lose data,
which must now fail at once naming the trainer and the fix. The README's
commands run as they are once each, Lightning's own launcher and torchrun (the
Accelerate example); the other runs fork their ranks from the rank server
(tests/helpers/trainer_runs.py), which imported the trainers once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import shardkit
from shardkit.epoch import SharedEpoch
from shardkit.pipeline import UnknownLengthError
from shardkit.planning import plan
from shardkit.topology import Topology
from shardkit.trainers import TrainerError, reader_lengths
from tests.helpers.examples import examples
from tests.helpers.reading import shut_down_workers
from tests.helpers.shards import all_ids, synthetic_read, synthetic_shards
from tests.helpers.trainer_runs import launch, launch_ranks, write_example_data

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
COUNTS = [40, 40, 40, 31]  # 151 samples: two workers share 76 + 75


def source(**kwargs) -> shardkit.ShardedDataset:
    return shardkit.ShardedDataset(synthetic_shards(COUNTS), synthetic_read, shuffle=True, **kwargs)


def epochs_of(loader, count: int = 2) -> list[list[str]]:
    return [[s for batch in loader for s in (batch if isinstance(batch, list) else [batch])] for _ in range(count)]


# -- epochs without set_epoch -------------------------------------------------------


def test_passes_count_epochs_until_set_epoch_is_called():
    dataset = source().shuffle(16)
    first, second = list(dataset), list(dataset)
    assert sorted(first) == sorted(second) == sorted(all_ids(synthetic_shards(COUNTS)))
    assert first != second, "a second pass without set_epoch repeated the first pass's order"
    fresh = source().shuffle(16)
    fresh.set_epoch(1)
    assert list(fresh) == second, "pass k must read exactly epoch k"
    assert list(fresh) == second, "an explicit set_epoch wins over counting"


def test_shared_epoch_counts_per_reader_slot_and_resumes_at_a_given_epoch():
    shared = SharedEpoch()
    assert not shared.explicit and shared.get() == 0
    shared.begin_pass()
    assert shared.get() == 0
    shared.begin_pass()
    assert shared.get() == 1
    shared.resume_at(5)
    assert shared.get() == 5
    shared.begin_pass()
    assert shared.get() == 5 and repr(shared) == "SharedEpoch(5, counted)"
    shared.set(2)
    shared.begin_pass()
    assert shared.get() == 2 and shared.explicit


@pytest.mark.parametrize("persistent", [True, False])
def test_dataloader_workers_reshuffle_every_epoch_without_set_epoch(persistent):
    dataset = source().shuffle(16)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    first, second = epochs_of(loader)
    assert sorted(first) == sorted(second) == sorted(all_ids(synthetic_shards(COUNTS)))
    assert first != second
    explicit = source().shuffle(16)
    explicit.set_epoch(1)
    assert list(DataLoader(explicit, batch_size=None, num_workers=2)) == second


def test_mixed_loader_reshuffles_every_epoch_without_set_epoch():
    loader = shardkit.MixedLoader(source().shuffle(16), batch_size=8, num_workers=2, collate_fn=list)
    first, second = epochs_of(loader)
    assert sorted(first) == sorted(second) and len(first) == 151
    assert first != second


def test_loading_a_state_makes_the_next_pass_read_its_epoch():
    dataset = source().shuffle(16)
    epochs = [list(dataset) for _ in range(3)]
    saved = source().shuffle(16)
    saved.set_epoch(1)
    iterator = iter(saved)
    head = [next(iterator) for _ in range(50)]
    state = saved.state_dict()
    resumed = source().shuffle(16)  # never set_epoch: counts from the state's epoch
    resumed.load_state_dict(state)
    assert head + list(resumed) == epochs[1]
    assert list(resumed) == epochs[2], "the pass after a resumed epoch reads the next epoch"


def test_stateful_dataloader_resumed_without_set_epoch_goes_on_with_the_next_epoch():
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(source().shuffle(16), batch_size=None, num_workers=2, persistent_workers=True)

    full = epochs_of(make(), 3)
    loader = make()
    list(loader)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(40)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())  # each worker loads its own state: epoch 1
    rest, after = epochs_of(resumed, 2)
    assert sorted(head + rest) == sorted(full[1]) and head == full[1][:40]
    assert after == full[2], "the epoch after a resumed one must be the next epoch, in every worker"


def test_mixed_loader_resumed_without_set_epoch_goes_on_with_the_next_epoch():
    def make() -> shardkit.MixedLoader:
        return shardkit.MixedLoader(source().shuffle(16), batch_size=8, num_workers=2, collate_fn=list)

    full = epochs_of(make(), 3)
    loader = make()
    list(loader)
    iterator = iter(loader)
    head = [s for _ in range(5) for s in next(iterator)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    rest, after = epochs_of(resumed, 2)
    assert head + rest == full[1]
    assert after == full[2]


def test_even_batches_resumed_without_set_epoch_goes_on_with_the_next_epoch():
    def make() -> shardkit.EvenBatches:
        loader = shardkit.MixedLoader(source().shuffle(16), batch_size=8, num_workers=2, collate_fn=list)
        return shardkit.even_batches(loader)

    full = epochs_of(make(), 3)
    loader = make()
    list(loader)
    iterator = iter(loader)
    head = [s for _ in range(5) for s in next(iterator)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    rest, after = epochs_of(resumed, 2)
    assert head + rest == full[1]
    assert after == full[2], "an epoch after the resumed one repeated its order"


def test_interleaved_sources_each_count_one_epoch_per_pass():
    def make() -> shardkit.Pipeline:
        other = shardkit.ShardedDataset(synthetic_shards([30, 30]), synthetic_read, shuffle=True, seed=1)
        return shardkit.interleave([source(), other], stop="all_exhausted")

    counted = make()
    first, second = list(counted), list(counted)
    explicit = make()
    explicit.set_epoch(1)
    assert first != second and list(explicit) == second and len(second) == 211


def test_repeat_inside_a_counted_pass_reads_consecutive_epochs_once():
    dataset = source()
    once = [list(dataset) for _ in range(3)]
    repeated = source().repeat(2)
    assert list(repeated) == once[0] + once[1]


# -- len() a trainer can trust -------------------------------------------------------


def test_dataloader_len_that_would_drop_batches_is_refused_and_iteration_still_delivers_all():
    dataset = source().map(str.upper)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list)
    with pytest.raises(UnknownLengthError, match=r"workers yield 20 batches.*\.batch\(8\).*MixedLoader"):
        len(loader)
    assert isinstance(UnknownLengthError("x"), TypeError)  # what Lightning's sized_len catches
    batches = list(loader)
    assert len(batches) == 20 and sum(map(len, batches)) == 151


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_len_is_kept_where_it_is_exact(workers):
    loader = DataLoader(source(), batch_size=8, num_workers=workers, collate_fn=list)
    assert len(loader) == 19 == len(list(loader))


def test_dataloader_len_is_kept_when_every_worker_share_fills_whole_batches():
    dataset = shardkit.ShardedDataset(synthetic_shards([40, 40]), synthetic_read)  # 40 + 40
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list)
    assert len(loader) == 10 == len(list(loader))


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_stage_len_counts_every_workers_last_batch(drop_last):
    batched = source().shuffle(16).batch(8, collate_fn=list, drop_last=drop_last)
    loader = DataLoader(batched, batch_size=None, num_workers=2)
    assert len(loader) == len(list(loader)) == (18 if drop_last else 20)
    assert len(batched) == (18 if drop_last else 19)  # outside a DataLoader: one reader


@settings(max_examples=examples(150), deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    world_size=st.integers(1, 3),
    num_workers=st.integers(1, 4),
    balance=st.sampled_from(["pad", "drop", "none"]),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
)
def test_batch_lengths_per_worker_match_the_plan(counts, world_size, num_workers, balance, batch_size, drop_last):
    assume(sum(counts) >= (world_size if balance == "drop" else 1))  # else plan() refuses: every rank empty
    for rank in range(world_size):
        dataset = shardkit.ShardedDataset(
            synthetic_shards(counts), synthetic_read, rank=rank, world_size=world_size, balance=balance
        )
        batched = dataset.map(str).shuffle(4).batch(batch_size, drop_last=drop_last)
        planned = []
        for worker in range(num_workers):
            topology = Topology(rank=rank, world_size=world_size, worker_id=worker, num_workers=num_workers)
            samples = sum(stop - start for _, start, stop in plan(counts, topology, balance=balance))
            planned.append(samples // batch_size if drop_last else -(-samples // batch_size))
        assert reader_lengths(batched, num_workers) == planned


def test_mixed_loader_len_is_exact_under_workers():
    loader = shardkit.MixedLoader(source(), batch_size=8, num_workers=2, collate_fn=list)
    assert len(loader) == 19 == len(list(loader))


# -- Accelerate's wrappers, in process --------------------------------------------------


def test_accelerate_iterable_dataset_shard_over_a_split_dataset_is_refused():
    from accelerate.data_loader import IterableDatasetShard

    dataset = source(rank=0, world_size=2).map(str.upper)
    wrapped = IterableDatasetShard(dataset, batch_size=8, num_processes=2, process_index=0)
    with pytest.raises(TrainerError, match=r"IterableDatasetShard splits.*send_to_device.*accelerate_train\.py"):
        next(iter(wrapped))


@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_skip_first_batches_on_a_shardkit_loader_is_refused_even_on_one_rank_naming_the_fix(workers):
    from accelerate import Accelerator

    loader = shardkit.MixedLoader(source().map(str.upper), batch_size=8, num_workers=workers, collate_fn=list)
    skipped = Accelerator(cpu=True).skip_first_batches(loader, 3)
    with pytest.raises(TrainerError, match=r"skip_first_batches\(loader, 3\).*reads the first 3 batches again.*"
                       r"register_for_checkpointing\(loader\)") as raised:  # fmt: skip
        next(iter(skipped))
    shut_down_workers(raised.value.__traceback__)  # now: left to the cycle collector, 5 s per worker
    assert len(list(loader)) == 19, "the loader itself still reads its epoch"


def test_accelerate_wrapper_on_one_rank_passes_every_sample():
    from accelerate.data_loader import IterableDatasetShard

    wrapped = IterableDatasetShard(source(), batch_size=151, num_processes=1, process_index=0)
    assert sorted(wrapped) == sorted(all_ids(synthetic_shards(COUNTS)))


# -- 2 ranks through each trainer ------------------------------------------------------


def check_records(record: Path, records: int = 302, epochs: int = 2) -> None:
    """Every id once per epoch over both ranks (302 split evenly: no padding),
    equal batch counts across ranks, and a new order every epoch."""
    orders = []
    for epoch in range(epochs):
        ranks = [json.loads((record / f"rank{r}-epoch{epoch}.json").read_text()) for r in range(2)]
        ids = ranks[0]["ids"] + ranks[1]["ids"]
        assert sorted(ids) == list(range(records)), f"epoch {epoch}: missing {set(range(records)) - set(ids)}"
        assert not [i for i, n in Counter(ids).items() if n > 1], f"epoch {epoch}: duplicates"
        assert ranks[0]["batches"] == ranks[1]["batches"], f"epoch {epoch}: unequal batch counts"
        orders.append(ranks[0]["ids"])
    assert orders[0] != orders[1], "epoch 1 repeated epoch 0's order"


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["mixed", "dataloader", "dataloader --reload"])
def test_lightning_ddp_trains_on_every_sample_each_epoch_in_a_new_order(tmp_path, loader):
    args = [str(EXAMPLES / "lightning_train.py"), "--loader", *loader.split(), "--record", str(tmp_path)]
    if loader == "mixed":  # the README's command: Lightning starts rank 1 itself
        done = launch(args, torchrun=False)
    else:  # ranks started together: the data is written before them
        write_example_data(EXAMPLES / "lightning_train.py", tmp_path / "data", 302)
        done = launch_ranks([*args, "--data", str(tmp_path / "data")])
    assert done.returncode == 0, done.stderr[-3000:]
    check_records(tmp_path)
    batches = 19 if loader == "mixed" else 20  # the plain DataLoader's workers each end with a partial batch
    assert f"rank 0 trained on 151 samples in {batches} batches" in done.stdout
    assert "could be inaccurate" not in done.stderr  # the README says why it does not apply; the example says so


@pytest.mark.slow
def test_accelerate_example_trains_on_every_sample_each_epoch_in_a_new_order(tmp_path):
    done = launch([str(EXAMPLES / "accelerate_train.py"), "--record", str(tmp_path)], torchrun=True)  # the README's
    assert done.returncode == 0, done.stderr[-3000:]
    check_records(tmp_path)


@pytest.mark.slow
def test_hf_trainer_example_trains_on_every_sample_each_epoch_in_a_new_order(tmp_path):
    done = launch_ranks([str(EXAMPLES / "hf_trainer.py"), "--record", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    check_records(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, expected, fix",
    [
        (
            ["accelerate-dispatch", "--workers", "2"],
            "Accelerate's DataLoaderDispatcher drives",
            "pass only the model and optimizer",
        ),
        (
            ["accelerate-dispatch", "--workers", "2", "--context", "spawn"],
            "Accelerate's DataLoaderDispatcher drives",
            "pass only the model and optimizer",
        ),
        (
            ["accelerate-shard"],
            "its IterableDatasetShard splits shardkit's already split stream again",
            "pass only the model and optimizer",
        ),
        (
            ["accelerate-skip", "--workers", "2"],
            "accelerator.skip_first_batches(loader, 8) over",
            "accelerator.register_for_checkpointing(loader) before accelerator.load_state",
        ),
        (
            ["accelerate-stateful", "--workers", "2"],
            "under DataLoaderConfiguration(use_stateful_dataloader=True)",
            "register it with accelerator.register_for_checkpointing(loader)",
        ),
        (["hf-trainer", "--workers", "2"], "the Hugging Face Trainer drives", "get_train_dataloader()"),
    ],
    ids=["dispatch", "dispatch-spawn", "shard", "skip-first-batches", "use-stateful-dataloader", "hf-trainer"],
)
def test_trainer_paths_that_would_lose_data_fail_at_once_naming_the_fix(mode, expected, fix, tmp_path):
    done = launch_ranks([str(ROOT / "tests" / "scripts" / "trainer_paths.py"), *mode, "--data", str(tmp_path)])
    assert done.returncode != 0 and "READ" not in done.stdout, done.stdout[-2000:]
    assert "SHARDKIT_ERROR" in done.stdout and expected in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert fix in done.stdout
    if mode[0] == "accelerate-stateful":  # a MixedLoader is not a DataLoader: prepare() gives it back as it is
        assert done.stdout.count("MIXED UNCHANGED") == 2


@pytest.mark.slow
def test_the_rank_server_gives_each_rank_torchruns_environment_and_ends_the_others_when_one_fails(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, time\n"
        "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['TORCHELASTIC_RUN_ID'][:11], sys.argv[1:])\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(300)  # rank 0 would wait for ever: the server ends it\n"
    )
    done = launch_ranks([str(script), "--flag"], timeout=120, grace=0.5)  # not the 5 s a killed run's ranks get
    assert done.stdout.splitlines() == ["0 2 rank-server ['--flag']", "1 2 rank-server ['--flag']"]
    assert done.returncode != 0 and "rank 1 exited with 3" in done.stderr
    assert "rank 0 ended by signal 9 (SIGKILL)" in done.stderr
