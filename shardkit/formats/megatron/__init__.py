"""Megatron-LM indexed datasets (``X.bin`` + ``X.idx``): read in place, one record per document, and written.

The package's modules, each importing only those listed after it:
:mod:`~shardkit.formats.megatron.format` (:class:`MegatronFormat`, what the sources
read with), :mod:`~shardkit.formats.megatron.writer` (:class:`PairWriter`, a pair
megatron-core reads back) and :mod:`~shardkit.formats.megatron.index` (the ``.idx``
parsed and checked, and where a pair's files are). The names below are the package's interface.
"""

from __future__ import annotations

from shardkit.formats.megatron.format import MegatronFormat, describe
from shardkit.formats.megatron.index import DTYPES, TokenIndex, bin_url, idx_url, parse_index, prefix_of
from shardkit.formats.megatron.writer import PairWriter

__all__ = [
    "DTYPES",
    "MegatronFormat",
    "PairWriter",
    "TokenIndex",
    "bin_url",
    "describe",
    "idx_url",
    "parse_index",
    "prefix_of",
]
