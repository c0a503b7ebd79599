"""The slab transport: collated micro-batches handed from a DataLoader worker
to the main process through reusable shared-memory buffers.

DataLoader creates a new shared-memory segment per tensor per batch and
passes its file descriptor over a socket (about 1 ms a batch, whatever its
size). Here each worker keeps a small :class:`SlabRing` of reusable
buffers, collates every tensor of a micro-batch (numbers and numpy arrays
included) straight into a free one, and sends only a :class:`SlabBatch`:
the slot number and the collated structure with an :class:`InSlab` place
for each tensor. The main process maps each buffer once (it comes along the
first time its slot is used), views the batch with :func:`from_slab`,
copies it out and clears the slot's flag in a shared flag array. Each side
writes one transition of a flag only: the worker sets it when it fills the
slot, the main process clears it when the rows are copied out.
Column batches (:mod:`shardkit.loader.slab_columns`) go into the same rings with
:meth:`SlabRing.put`: one place per column, bytes as values and offsets.

A worker that finds no free slot, or a tensor a slab cannot hold (sparse,
nested, quantized, a subclass, not on the CPU), sends what
``default_collate`` makes, the DataLoader way, so a slow consumer never
blocks it. The buffers are torch's unlinked shared memory: nothing stays in
``/dev/shm`` when a process dies, and a ring is dropped with its epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from shardkit.loader.collate import same_mapping_type
from shardkit.loader.slab_columns import Binary, BinaryInSlab, held

__all__ = ["SPARE_SLOTS", "InSlab", "SlabBatch", "SlabRing", "from_slab", "view"]

#: Slots of a worker's slab ring beyond the DataLoader's ``prefetch_factor``
#: messages in flight: the main process holds up to two micro-batches per
#: worker, and the worker collates one.
SPARE_SLOTS = 3
#: torch dtypes of the numpy dtypes columns usually hold (the others are looked up).
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32, np.dtype(np.uint8): torch.uint8}
#: Byte alignment of each tensor inside a slab (any dtype can view it).
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class InSlab:
    """Where one collated tensor of a micro-batch lies in its slab."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class SlabBatch:
    """A micro-batch in slot ``slot`` of its worker's ring: ``skeleton`` is what
    ``default_collate`` makes, with :class:`InSlab` for each tensor. ``slab``
    is sent only when the slot holds a new buffer (the main process keeps it)."""

    slot: int
    slab: torch.Tensor | None
    skeleton: Any


class _NotInSlab(Exception):
    """A tensor the slab cannot hold (sparse, nested, quantized, a subclass, not on the CPU)."""


class _Layout:
    """Lays out one micro-batch's collated tensors in a slab: the collate
    functions return :class:`InSlab` places and :meth:`write` fills them."""

    def __init__(self) -> None:
        self.size = 0
        self._writes: list[tuple[InSlab, Any]] = []
        self.fn_map: dict[Any, Callable[..., Any]] = dict(default_collate_fn_map)
        self.fn_map[torch.Tensor] = self._stack
        for kind in (int, float, (np.bool_, np.number, np.object_)):
            self.fn_map[kind] = self._wrap(default_collate_fn_map[kind])

    def _place(self, shape: tuple[int, ...], dtype: torch.dtype, numel: int, source: Any) -> InSlab:
        place = InSlab(self.size, shape, dtype)
        nbytes = numel * dtype.itemsize
        self.size += -(-nbytes // _ALIGN) * _ALIGN
        self._writes.append((place, source))
        return place

    def _stack(self, batch: Sequence[torch.Tensor], **_: Any) -> InSlab:
        elem = batch[0]
        if type(elem) is not torch.Tensor or elem.layout != torch.strided or elem.device.type != "cpu":
            raise _NotInSlab  # subclasses keep their type, as default_collate keeps it
        if elem.is_nested or elem.is_quantized:
            raise _NotInSlab
        return self._place((len(batch), *elem.shape), elem.dtype, len(batch) * elem.numel(), batch)

    def _wrap(self, make_tensor: Callable[..., Any]) -> Callable[..., Any]:
        def in_slab(batch: list[Any], **kwargs: Any) -> InSlab:
            tensor = make_tensor(batch, **kwargs)
            return self._place(tuple(tensor.shape), tensor.dtype, tensor.numel(), tensor)

        return in_slab

    def column(self, column: np.ndarray | Binary) -> InSlab | BinaryInSlab | np.ndarray:
        """Place a column of a column batch (:mod:`shardkit.loader.slab_columns`); bytes as values and offsets from 0.
        A column of values other than numbers (:func:`~shardkit.loader.slab_columns.held`) stays in the skeleton."""
        if held(column):
            return column  # type: ignore[return-value]  # held() is true only for arrays
        if isinstance(column, Binary):
            low, high = int(column.offsets[0]), int(column.offsets[-1])
            values = self.column(column.values[low:high])
            return BinaryInSlab(values, self.column(column.offsets - low), column.list_size)
        dtype = _TORCH_DTYPES.get(column.dtype) or torch.from_numpy(column[:0]).dtype
        return self._place(tuple(column.shape), dtype, column.size, column)

    def write(self, slab: torch.Tensor) -> None:
        for place, source in self._writes:
            target = view(slab, place)
            if isinstance(source, np.ndarray):
                target.numpy()[...] = source
            elif isinstance(source, torch.Tensor):
                target.copy_(source)
            else:  # a list or tuple of samples' tensors
                torch.stack(source, 0, out=target)


def view(slab: torch.Tensor, place: InSlab) -> torch.Tensor:
    """The tensor at ``place`` in ``slab``."""
    numel = math.prod(place.shape)
    return slab[place.offset : place.offset + numel * place.dtype.itemsize].view(place.dtype).view(place.shape)


class SlabRing:
    """A worker's reusable shared-memory buffers and their busy flags.

    The worker sets a slot's flag when it fills it, the main process clears
    it once the micro-batch is copied out: each side writes one transition
    only. Buffers grow (a new one in the slot, sent along) when a
    micro-batch does not fit.
    """

    def __init__(self, slots: int) -> None:
        self.flags = torch.zeros(slots, dtype=torch.uint8).share_memory_()
        self._busy = self.flags.numpy()
        self._slabs: list[torch.Tensor | None] = [None] * slots
        self.used = 0  #: the bytes of the latest micro-batch put in a slab

    def collate(self, chunk: list[Any]) -> Any:
        """``default_collate(chunk)``, its tensors in a free slot; as
        DataLoader sends it when no slot is free or a tensor cannot go in one."""
        free = np.flatnonzero(self._busy == 0)
        if not len(free):
            return default_collate(chunk)
        layout = _Layout()
        try:
            skeleton = collate(chunk, collate_fn_map=layout.fn_map)
        except _NotInSlab:
            return default_collate(chunk)
        return self._fill(int(free[0]), layout, skeleton)

    def put(self, parts: dict[str, np.ndarray | Binary]) -> Any:
        """A column batch (:func:`shardkit.loader.slab_columns.as_parts` form) in a free slot, or
        as it is when no slot is free."""
        free = np.flatnonzero(self._busy == 0)
        if not len(free):
            return parts
        layout = _Layout()
        skeleton = {name: layout.column(column) for name, column in parts.items()}
        return self._fill(int(free[0]), layout, skeleton)

    def _fill(self, slot: int, layout: _Layout, skeleton: Any) -> SlabBatch:
        """Write ``layout``'s tensors into ``slot`` (a larger buffer if they do not fit) and mark it busy."""
        slab = self._slabs[slot]
        new = slab is None or len(slab) < layout.size
        if new:  # with room to spare, so that sizes that vary a little do not reallocate
            slab = torch.empty(layout.size + layout.size // 8 + _ALIGN, dtype=torch.uint8).share_memory_()
            self._slabs[slot] = slab
        assert slab is not None
        self._busy[slot] = 1
        self.used = layout.size
        layout.write(slab)
        return SlabBatch(slot, slab if new else None, skeleton)


def from_slab(value: Any, slab: torch.Tensor) -> Any:
    """A slab batch's skeleton with each :class:`InSlab` replaced by a view of ``slab``."""
    if type(value) is InSlab:
        return view(slab, value)
    if isinstance(value, Mapping):
        return same_mapping_type(value, {key: from_slab(item, slab) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(from_slab(item, slab) for item in value))
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], (str, bytes))):
        return type(value)(from_slab(item, slab) for item in value)
    return value
