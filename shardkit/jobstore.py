"""Work done once per job: the first rank to ask does it, the others take its answer from the group's store.

Listing a glob (:mod:`shardkit.listing`) and looking up the counts stored
with every shard (:mod:`shardkit.counting`) cost requests per shard; every
rank doing them multiplies both, and ranks that look at different moments
can see different files. Under an initialised ``torch.distributed`` process
group both go through :func:`once_per_job`: the first rank to claim a key
does the work and puts its answer in the group's key-value store (the one
``init_process_group`` rendezvoused through); the others wait for it there.

Not a collective: a rank that arrives first never waits for the others, so
work asked on rank 0 alone (an evaluation dataset) runs as it would without
a group. A key names the work and how many times this process asked for it
(:func:`job_key`): the *k*-th ask on each rank shares the *k*-th answer, so
a job that rebuilds its dataset every epoch does the work once per epoch,
not once per rank per epoch. Work that fails puts its error under the key,
so the ranks that wait raise instead of hanging. Answers are bytes the
caller encodes and decodes (plain data, never pickle).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from shardkit.errors import redact

__all__ = ["WAIT", "group_store", "job_key", "once_per_job", "tidy_keys"]

#: How long a rank waits for another's answer: a listing of millions of objects takes minutes at worst.
WAIT: timedelta = timedelta(minutes=30)

_OK, _ERROR = b"ok:", b"error:"
_asked: Counter[str] = Counter()  # how often this process asked for each piece of work: the k-th shares the k-th
_asked_lock = threading.Lock()

Result = TypeVar("Result")


def group_store() -> Any:
    """The process group's key-value store, or None (no group, one rank, or a torch without it)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:  # pragma: no cover - torch without distributed: each rank works for itself
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return _get_default_store()


def job_key(kind: str, named: object) -> str | None:
    """The store key of this process's next ask for the work ``named`` (plain data) of ``kind``: the same
    on every rank for its k-th ask, or None when ``named`` is not plain data (it could differ between
    ranks unseen, so each rank must work for itself)."""
    try:
        text = json.dumps(named, sort_keys=True)
    except (TypeError, ValueError):
        return None
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    with _asked_lock:
        _asked[digest] += 1
        return f"shardkit/{kind}/{digest}/{_asked[digest]}"


def once_per_job(
    store: Any,
    key: str,
    work: Callable[[], tuple[Result, bytes]],
    taken: Callable[[bytes], Result],
    failed: Callable[[str], Exception],
) -> Result:
    """``work()``'s result on the first rank to claim ``key``, which shares its answer (the bytes ``work``
    returns beside the result); ``taken(answer)`` on the others. If the first rank's ``work`` raises, it
    re-raises and the others raise ``failed(its error's text)`` (credentials redacted)."""
    if store.add(f"{key}/claim", 1) == 1:
        try:
            result, answer = work()
        except Exception as error:  # every rank must learn of it, or the others wait forever
            store.set(key, _ERROR + f"{type(error).__name__}: {redact(str(error))}".encode())
            raise
        store.set(key, _OK + answer)
        return result
    store.wait([key], WAIT)
    value = bytes(store.get(key))
    if value.startswith(_ERROR):
        raise failed(value[len(_ERROR) :].decode(errors="replace"))
    return taken(value[len(_OK) :])


def tidy_keys(store: Any, prefix: str, keys: list[str], world_size: int) -> None:
    """Called by every rank after reading ``keys``: the last of ``world_size`` to call removes them
    (the store lives as long as the job). A rank that never calls leaves them behind: small."""
    try:
        if store.add(prefix + "read", 1) == world_size:
            for key in [*keys, prefix + "read"]:
                store.delete_key(key)
    except Exception:  # noqa: BLE001, S110 - a store that cannot delete: the keys stay, which is harmless
        pass
