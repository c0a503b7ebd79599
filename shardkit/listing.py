"""List a glob once per job, not once per rank or worker.

Listing a bucket of a million objects takes thousands of LIST requests and
tens of seconds; every rank doing it multiplies both and can trip the store's
request limits. DataLoader workers never list: a dataset is built in the main
process and carries its ShardList to them (pickled or forked, a list of urls,
counts and sizes). Between ranks, two ways:

- **By default** (:func:`shared_listing`, what a dataset given a glob uses):
  under an initialised ``torch.distributed`` process group, the *first* rank
  to build a dataset over a glob lists it and puts the listing in the group's
  key-value store (the one ``init_process_group`` rendezvoused through); the
  others read it from there. Not a collective: a rank that arrives first never
  waits, so a dataset built on rank 0 alone (evaluation) works as before, and
  ranks need not build their datasets at the same moment. The *k*-th dataset
  a rank builds over a pattern (and storage options) shares the listing of
  every rank's *k*-th: a job that rebuilds its dataset each epoch re-lists
  once per epoch, not once per rank per epoch. Without a process group (or
  with options that cannot be named the same on every rank) each process
  lists for itself.
- **A collective** (:func:`list_shards`): every rank calls it; rank 0 lists
  and broadcasts the result through the group as one buffer in a ``uint8``
  tensor.

Either way the listing travels as one Arrow IPC buffer of urls and sizes
(plain data, no pickle; the shared listing adds each file's identity, which the
counts cache checks its entries against instead of listing again per reader), so every rank plans over the very same list, and a
listing that fails fails on every rank that waits for it, with the lister's
error, instead of hanging.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.errors import redact
from shardkit.io.identity import listed_identities, remember
from shardkit.io.retry import RetryPolicy
from shardkit.jobstore import group_store, job_key, once_per_job
from shardkit.shardlist import ShardList, ShardListError

__all__ = ["list_shards", "shared_listing"]

_FAILED = -1


def list_shards(
    pattern: str, storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None
) -> ShardList:
    """``ShardList.from_glob(pattern)``, listed by rank 0 only when a process group is initialised.

    Every rank of the group must call it (it is a collective), with the same pattern.
    Datasets given a glob do not call it: they use :func:`shared_listing`, which lists
    once per job too but is no collective, so that building a dataset on some ranks
    only never waits for the others. Use it as
    ``TFRecordDataset(list_shards("s3://bucket/train-*.tfrecord"))`` where every rank
    should hold the listing at the same point (e.g. before building anything).
    ``retry`` bounds and retries the listing's requests (:meth:`ShardList.from_glob`).
    """
    group = _process_group()
    if group is None:
        return ShardList.from_glob(pattern, storage_options, retry)
    import torch.distributed as dist

    payload = b""
    if dist.get_rank() == 0:
        try:
            payload = _to_ipc(ShardList.from_glob(pattern, storage_options, retry).table)
        except Exception as error:  # every rank must learn of it, or the others wait forever
            _broadcast(_FAILED, f"{type(error).__name__}: {redact(str(error))}".encode())
            raise
    length, data = _broadcast(len(payload), payload)
    if length == _FAILED:
        raise ShardListError(f"rank 0 could not list {pattern!r}: {data.decode(errors='replace')}")
    table = pa.ipc.open_stream(data).read_all()
    return ShardList(table.column("url"), sizes=table.column("size"))


def _process_group() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


def _to_ipc(table: pa.Table, identities: list[str | None] | None = None) -> bytes:
    """Urls and sizes (and the identities the listing saw) as one Arrow IPC stream."""
    table = table.select(["url", "size"])
    if identities is not None:
        table = table.append_column("identity", pa.array(identities, pa.string()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _broadcast(length: int, payload: bytes) -> tuple[int, bytes]:
    """Rank 0's ``(length, payload)`` on every rank: the length first, then the bytes."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    head = torch.tensor([length, len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    length, size = (int(v) for v in head.tolist())
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buffer.copy_(torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()))
    dist.broadcast(buffer, src=0)
    return length, buffer.cpu().numpy().tobytes()


def shared_listing(
    pattern: str, storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None
) -> ShardList:
    """``ShardList.from_glob(pattern)``, listed once per job under a process group (see the module doc);
    ``retry`` bounds and retries the listing's requests."""
    store = group_store()
    key = job_key("listing", [pattern, dict(storage_options or {})]) if store is not None else None
    if store is None or key is None:
        return ShardList.from_glob(pattern, storage_options, retry)

    def work() -> tuple[ShardList, bytes]:
        shards = ShardList.from_glob(pattern, storage_options, retry)
        return shards, _to_ipc(shards.table, listed_identities(shards.urls())[1])

    def failed(error: str) -> ShardListError:
        return ShardListError(f"another rank listed {pattern!r} for this one and failed: {error}")

    return once_per_job(store, key, work, _from_ipc, failed)


def _from_ipc(answer: bytes) -> ShardList:
    """The listing another rank shared (:func:`_to_ipc`), its identities remembered for the counts cache."""
    table = pa.ipc.open_stream(answer).read_all()
    remember(table.column("url").to_pylist(), table.column("identity").to_pylist())
    return ShardList(table.column("url"), sizes=table.column("size"))
