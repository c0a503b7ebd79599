"""List a glob once per job, not once per rank: rank 0 lists, the others receive its listing.

Listing a bucket of a million objects takes thousands of LIST requests and
tens of seconds; every rank doing it multiplies both and can trip the store's
request limits. Under an initialised ``torch.distributed`` process group,
:func:`list_shards` has rank 0 call :meth:`ShardList.from_glob` and broadcast
the result through the group as one Arrow IPC buffer in a ``uint8`` tensor
(urls and sizes; plain data, no pickle), so every rank plans over the very
same list. DataLoader workers never list: the dataset is built in the main
process and carries its ShardList to them. If rank 0 cannot list, every rank
raises the same error instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from shardkit.shardlist import ShardList, ShardListError

__all__ = ["list_shards"]

_FAILED = -1


def list_shards(pattern: str, storage_options: Mapping[str, Any] | None = None) -> ShardList:
    """``ShardList.from_glob(pattern)``, listed by rank 0 only when a process group is initialised.

    Every rank of the group must call it (it is a collective), with the same pattern;
    datasets given a glob do not call it (each process lists for itself), so that
    building a dataset on some ranks only never waits for the others. Use it as
    ``TFRecordDataset(list_shards("s3://bucket/train-*.tfrecord"))``.
    """
    group = _process_group()
    if group is None:
        return ShardList.from_glob(pattern, storage_options)
    import torch.distributed as dist

    payload = b""
    if dist.get_rank() == 0:
        try:
            payload = _to_ipc(ShardList.from_glob(pattern, storage_options).table)
        except Exception as error:  # every rank must learn of it, or the others wait forever
            _broadcast(_FAILED, f"{type(error).__name__}: {error}".encode())
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


def _to_ipc(table: pa.Table) -> bytes:
    table = table.select(["url", "size"])
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
