"""Sources: IterableDatasets that split their records by the plan when iteration starts.

``ShardedDataset`` reads shard files with any ``read_fn(url, start, stop)``;
``FormatDataset`` reads shards of any :class:`~shardkit.formats.base.ShardFormat`,
and ``TFRecordDataset``, ``TarDataset``, ``ParquetDataset``, ``JsonlDataset`` and
``TokenDataset`` (Megatron ``.bin``/``.idx``) are it for the built-in formats; ``wrap`` turns a map-style dataset (one with
``__len__`` and ``__getitem__``) or a plain iterable into a source.

The modules are layered, each importing only those below it (the import-linter
contract in ``pyproject.toml``):

* :mod:`~shardkit.sources.formatted`: the format datasets;
* :mod:`~shardkit.sources.sharded` (``ShardedDataset``, bad-record accounting)
  and :mod:`~shardkit.sources.wrap` (``wrap``);
* :mod:`~shardkit.sources.planned`: sources over planned record ranges, their
  plan, fingerprint, resuming and hints;
* :mod:`~shardkit.sources.window` and :mod:`~shardkit.sources.ranges`: the
  iterators a planned source reads with;
* :mod:`~shardkit.sources.base`: what every source shares (seed, epoch, topology);
* :mod:`~shardkit.sources.options` and :mod:`~shardkit.sources.errors`.

Importing this package registers the ``"planned"`` and ``"stream"`` stage kinds
(see :mod:`shardkit.state`).
"""

from shardkit.sources.errors import MADE_UP_MISSING, BalanceError, DatasetError
from shardkit.sources.formatted import (
    ArrayRecordDataset,
    FormatDataset,
    JsonlDataset,
    MDSDataset,
    ParquetDataset,
    TarDataset,
    TFRecordDataset,
    TokenDataset,
)
from shardkit.sources.sharded import ShardedDataset
from shardkit.sources.wrap import MapSource, StreamSource, wrap

__all__ = [
    "ArrayRecordDataset",
    "MADE_UP_MISSING",
    "BalanceError",
    "DatasetError",
    "FormatDataset",
    "JsonlDataset",
    "MDSDataset",
    "MapSource",
    "ParquetDataset",
    "ShardedDataset",
    "StreamSource",
    "TFRecordDataset",
    "TarDataset",
    "TokenDataset",
    "wrap",
]
