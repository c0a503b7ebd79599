"""once_per_job over a real torch key-value store (a HashStore, as a process group's store behaves)."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore

from shardkit.errors import ShardkitError
from shardkit.jobstore import job_key, once_per_job, tidy_keys


def _never(answer: bytes) -> str:
    raise AssertionError("the first rank to claim a key does the work itself")


def test_the_first_to_claim_a_key_does_the_work_and_the_others_take_its_answer():
    store, key = HashStore(), "shardkit/test/a/1"
    done = []

    def work() -> tuple[str, bytes]:
        done.append(1)
        return "listed", b"answer"

    assert once_per_job(store, key, work, _never, ShardkitError) == "listed"
    taken = [once_per_job(store, key, work, lambda answer: answer.decode(), ShardkitError) for _ in range(3)]
    assert taken == ["answer"] * 3 and done == [1]


def test_work_that_fails_fails_every_rank_that_waits_with_its_error_and_no_credentials():
    store, key = HashStore(), "shardkit/test/b/1"

    def work() -> tuple[str, bytes]:
        raise FileNotFoundError("https://user:s3cr3t@host/a.tfrecord?X-Amz-Signature=SIG not found")

    with pytest.raises(FileNotFoundError):
        once_per_job(store, key, work, _never, ShardkitError)
    with pytest.raises(
        ShardkitError, match=r"FileNotFoundError: https://\*\*\*@host/a.tfrecord\?X-Amz-Signature=\*\*\*"
    ) as caught:
        once_per_job(store, key, work, lambda answer: answer, lambda error: ShardkitError(error))
    assert "s3cr3t" not in str(caught.value) and "SIG" not in str(caught.value)


def test_the_kth_ask_for_the_same_work_gets_the_kth_key_and_other_work_another():
    first, second = job_key("test-k", ["pattern", {}]), job_key("test-k", ["pattern", {}])
    assert first is not None and second is not None and first != second
    assert first.rsplit("/", 1)[0] == second.rsplit("/", 1)[0]
    assert int(second.rsplit("/", 1)[1]) == int(first.rsplit("/", 1)[1]) + 1
    other = job_key("test-k", ["another", {}])
    assert other is not None and other.rsplit("/", 1)[0] != first.rsplit("/", 1)[0]


def test_work_named_by_what_is_not_plain_data_has_no_key():
    assert job_key("test-k", ["pattern", {"client": object()}]) is None


def test_the_last_of_the_ranks_to_read_removes_the_keys_and_not_before():
    store = HashStore()
    keys = ["gather/0", "gather/1", "gather/2"]
    for key in keys:
        store.set(key, b"state")
    tidy_keys(store, "gather/", keys, world_size=3)
    tidy_keys(store, "gather/", keys, world_size=3)
    assert store.check(keys)  # two of three have read: the third still needs them
    tidy_keys(store, "gather/", keys, world_size=3)
    assert [store.check([key]) for key in [*keys, "gather/read"]] == [False] * 4


def test_a_store_that_cannot_delete_keeps_the_keys_without_an_error():
    class NoDelete(HashStore):
        def delete_key(self, key: str) -> bool:
            raise RuntimeError("this store cannot delete")

    store = NoDelete()
    store.set("k/0", b"x")
    tidy_keys(store, "k/", ["k/0"], world_size=1)
    assert store.get("k/0") == b"x"
