"""shardkit: IterableDataset pipelines over shard files that are correct and fast
across DataLoader workers and DDP ranks.

Public names are imported lazily so that ``import shardkit`` stays cheap in
every DataLoader worker; each name lives in the module listed below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardkit._version import __version__
from shardkit.errors import CorruptRecordError, EvenBatchesError, ShardkitError, WorkerDiedError

_EXPORTS: dict[str, str] = {
    "ShardList": "shardkit.shardlist",
    "Topology": "shardkit.topology",
    "plan": "shardkit.planning",
    "Range": "shardkit.planning",
    "read_tfrecord": "shardkit.formats.tfrecord",
    "read_tfrecord_batches": "shardkit.formats.tfrecord",
    "TFRecordWriter": "shardkit.formats.tfrecord",
    "build_index": "shardkit.formats.tfrecord.index",
    "ShardWriter": "shardkit.writer",
    "decode_columns": "shardkit.formats.example",
    "decode_example": "shardkit.formats.example",
    "decode_sequence_example": "shardkit.formats.example",
    "encode_example": "shardkit.formats.example",
    "ShardedDataset": "shardkit.sources",
    "TFRecordDataset": "shardkit.sources",
    "TarDataset": "shardkit.sources",
    "ParquetDataset": "shardkit.sources",
    "JsonlDataset": "shardkit.sources",
    "TokenDataset": "shardkit.sources",
    "LitDataDataset": "shardkit.sources.litdata",
    "LanceDataset": "shardkit.sources.lance",
    "ArrayRecordDataset": "shardkit.sources",
    "MDSDataset": "shardkit.sources",
    "TokenWriter": "shardkit.writer",
    "FormatDataset": "shardkit.sources",
    "wrap": "shardkit.sources",
    "interleave": "shardkit.pipeline",
    "Schedule": "shardkit.planning",
    "mixture_shares": "shardkit.pipeline",
    "Pipeline": "shardkit.pipeline",
    "MixedLoader": "shardkit.loader",
    "StatefulDataLoader": "shardkit.loader.stateful_loader",
    "worker_seed": "shardkit.seeding",
    "record_seed": "shardkit.seeding",
    "shuffle_quality": "shardkit.quality",
    "even_batches": "shardkit.even",
    "EvenBatches": "shardkit.even",
    "EvenStats": "shardkit.even",
    "ShardFormat": "shardkit.formats.base",
    "register_format": "shardkit.formats.registry",
    "format_for": "shardkit.formats.registry",
    "IndexFileError": "shardkit.formats.offsets",
    "DuplicateShardWarning": "shardkit.shardlist",
    "TrainerError": "shardkit.trainers",
}

__all__ = ["__version__", "CorruptRecordError", "EvenBatchesError", "ShardkitError", "WorkerDiedError", *_EXPORTS]


#: Submodules reachable as attributes after a plain ``import shardkit`` (``shardkit.state.gather(...)``).
_SUBMODULES = ("state",)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"shardkit.{name}")  # importing binds it on the package
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES])


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only  # noqa: F401
    from shardkit.even import EvenBatches, EvenStats, even_batches
    from shardkit.formats.base import ShardFormat
    from shardkit.formats.example import decode_columns, decode_example, decode_sequence_example, encode_example
    from shardkit.formats.offsets import IndexFileError
    from shardkit.formats.registry import format_for, register_format
    from shardkit.formats.tfrecord import TFRecordWriter, read_tfrecord, read_tfrecord_batches
    from shardkit.formats.tfrecord.index import build_index
    from shardkit.loader import MixedLoader
    from shardkit.loader.stateful_loader import StatefulDataLoader
    from shardkit.pipeline import Pipeline, interleave, mixture_shares
    from shardkit.planning import Range, Schedule, plan
    from shardkit.quality import shuffle_quality
    from shardkit.seeding import record_seed, worker_seed
    from shardkit.shardlist import DuplicateShardWarning, ShardList
    from shardkit.sources import (
        ArrayRecordDataset,
        FormatDataset,
        JsonlDataset,
        MDSDataset,
        ParquetDataset,
        ShardedDataset,
        TarDataset,
        TFRecordDataset,
        TokenDataset,
        wrap,
    )
    from shardkit.sources.lance import LanceDataset
    from shardkit.sources.litdata import LitDataDataset
    from shardkit.topology import Topology
    from shardkit.trainers import TrainerError
    from shardkit.writer import ShardWriter, TokenWriter
