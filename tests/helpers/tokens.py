"""Megatron token files for tests: documents that name themselves (a document's first token is its
number), a pair written with them, and where the parts of its ``.idx`` start.

Module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

import shardkit

_rng = np.random.default_rng(25)
DOCS: list[np.ndarray] = [
    np.concatenate(([i], _rng.integers(0, 60_000, size=int(_rng.integers(0, 40))))).astype(np.int64) for i in range(60)
]
"""60 documents of 1 to 40 tokens; document ``i`` starts with the token ``i``."""

IDX_AT = {"lengths": 34, "pointers": 34 + 4 * len(DOCS), "indices": 34 + 12 * len(DOCS)}
"""Where the sequence lengths, pointers and document indices of :func:`write_pair`'s ``.idx`` start."""


def write_pair(directory: Path | str, docs: list[np.ndarray] = DOCS, *, name: str = "x", dtype: Any = np.int32) -> str:
    """Write ``docs`` (one sequence each) as ``directory/name.bin`` + ``.idx``; return the prefix."""
    prefix = str(Path(directory) / name)
    with shardkit.TokenWriter(prefix, dtype=dtype) as writer:
        for tokens in docs:
            writer.write(tokens)
    return prefix


def read_tokens(records: Iterable[Any]) -> list[np.ndarray]:
    """The token arrays of ``records`` (``{"input_ids": array}``)."""
    return [record["input_ids"] for record in records]


def first_token(record: dict[str, np.ndarray]) -> int:
    """A document's number (its first token, see :data:`DOCS`)."""
    return int(record["input_ids"][0])
