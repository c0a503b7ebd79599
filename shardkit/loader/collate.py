"""Re-joining ``default_collate`` outputs: slices of collated micro-batches
joined into what ``default_collate`` makes of all their samples.

:class:`~shardkit.MixedLoader` has its workers collate micro-batches, then
cuts each output batch from several of them. Collating again sample by
sample would cost a Python object per sample; instead :func:`join` walks the
collated structure once and concatenates each tensor's rows (one copy per
tensor per batch). The structure is the one ``default_collate`` builds:

* a tensor per leaf that becomes a tensor (tensors, numbers, numpy arrays),
  joined along dimension 0;
* a mapping of the samples' type, a named tuple, or a list with one
  collated value per field of a sequence sample, joined field by field;
* strings and bytes kept as they come, along the batch: a list at the top,
  a tuple inside a sequence (from ``zip``).

Joined tensors may be views of their parts when nothing else asks for a
copy; a part in a shared-memory slab that its worker will write again must
be joined with ``copy=True``, and a part kept in a saved state is taken with
:func:`tail`, which owns its memory (a view would keep, and encode, the
whole micro-batch).
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

__all__ = ["Part", "collated_length", "concat", "join", "own_memory", "same_mapping_type", "tail"]

#: ``(payload, start, stop)``: samples ``start:stop`` of one collated micro-batch.
Part = tuple[Any, int, int]

#: Copies below this many elements run on one thread in torch too (its grain size).
_SERIAL_COPY_ELEMENTS = 32768


def join(parts: list[Part], *, copy: bool = False) -> Any:
    """Join slices ``payload[start:stop]`` of ``default_collate`` outputs along
    the batch dimension, into what ``default_collate`` makes of all samples;
    with ``copy`` no tensor of the result shares memory with ``parts`` (whose
    slabs are about to be reused)."""
    first = parts[0][0]
    if isinstance(first, torch.Tensor):
        if len(parts) == 1 and not copy:
            tensor, start, stop = parts[0]
            return tensor if start == 0 and stop == len(tensor) else tensor[start:stop]
        return concat([tensor[start:stop] for tensor, start, stop in parts])
    if isinstance(first, Mapping):
        joined = {key: join([(p[key], a, b) for p, a, b in parts], copy=copy) for key in first}
        return same_mapping_type(first, joined)
    if _is_named_tuple(first):
        return type(first)(*_join_fields(parts, copy=copy))
    if _is_strings(first):
        return type(first)(item for p, a, b in parts for item in p[a:b])
    if isinstance(first, list):
        # Any other list holds one collated value per field of the samples.
        return _join_fields(parts, copy=copy)
    raise TypeError(
        f"cannot join micro-batches of type {type(first).__name__}: only default_collate's output "
        "(tensors, mappings, named tuples, lists, strings and bytes) can be joined; pass a collate_fn "
        "to MixedLoader to batch other types in the main process"
    )


def _join_fields(parts: list[Part], *, copy: bool) -> list[Any]:
    return [join([(p[i], a, b) for p, a, b in parts], copy=copy) for i in range(len(parts[0][0]))]


def concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along dim 0 into new memory, large copies done by numpy where the dtype allows.

    The main process shares the CPU with busy workers; torch's intra-op
    threads then spin and wait for each other, which made ``torch.cat`` of
    3x224x224 images 2-3x slower than numpy's single-threaded copy in
    ``benchmarks/mixing.py``.
    """
    if sum(t.numel() for t in tensors) < _SERIAL_COPY_ELEMENTS:
        return torch.cat(tensors)
    rows = sum(len(t) for t in tensors)
    out = torch.empty((rows, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    try:
        np.concatenate([t.numpy() for t in tensors], out=out.numpy())
    except TypeError:  # a dtype numpy lacks, such as bfloat16
        torch.cat(tensors, out=out)
    return out


def tail(payload: Any, start: int, stop: int, *, collated: bool) -> Any:
    """Samples ``start:stop`` of a micro-batch (collated, or a list of samples),
    in memory of their own (a slice of a tensor would otherwise keep the whole
    micro-batch's storage)."""
    if not collated:
        return payload[start:stop]
    return own_memory(join([(payload, start, stop)]))


def own_memory(value: Any) -> Any:
    """``value`` with every tensor in it copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        return same_mapping_type(value, {key: own_memory(item) for key, item in value.items()})
    if _is_named_tuple(value):
        return type(value)(*map(own_memory, value))
    if isinstance(value, (list, tuple)):
        return type(value)(map(own_memory, value))
    return value


def same_mapping_type(template: Mapping[Any, Any], values: dict[Any, Any]) -> Mapping[Any, Any]:
    """``values`` in a mapping of ``template``'s type where it can be copied and
    updated (as ``default_collate`` keeps the sample's mapping type), else a dict."""
    if isinstance(template, MutableMapping):
        clone = _copy.copy(template)
        clone.update(values)
        return clone
    return values


def collated_length(value: Any) -> int | None:
    """The number of samples in a ``default_collate`` output, read as :func:`join`
    reads it; None if ``value`` is not one, or its parts disagree."""
    if isinstance(value, torch.Tensor):
        return len(value) if value.dim() else None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, bytes)) for v in value):
        return len(value)
    if isinstance(value, (Mapping, list)):
        lengths = {collated_length(v) for v in (value.values() if isinstance(value, Mapping) else value)}
        return lengths.pop() if len(lengths) == 1 else None
    return None


def _is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_strings(value: Any) -> bool:
    """A list or tuple of strings or bytes: default_collate keeps those as they come."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], (str, bytes))
