"""A LitData dataset's ``index.json``, read and checked: its chunks in order with their counts, and how
their items decode; what cannot be read without running code is refused here, before any chunk is read."""

from __future__ import annotations

import json
import posixpath
from typing import Any, Final, NamedTuple

from shardkit.errors import ShardkitError
from shardkit.formats.litdata.leaves import LEAVES, leaf_count, parse_spec

__all__ = ["INDEX_NAME", "LitDataIndex", "chunk_urls", "index_url", "parse_index"]

INDEX_NAME: Final = "index.json"


class LitDataIndex(NamedTuple):
    """A checked ``index.json``: the chunks in order and how their items decode."""

    url: str
    filenames: tuple[str, ...]
    items: tuple[int, ...]
    tokens: tuple[int | None, ...]
    leaves: tuple[str, ...]
    spec: Any
    compression: str | None
    tokens_loader: bool

    def chunk(self, url: str) -> int:
        """The position of the chunk file ``url`` in the index."""
        name = posixpath.basename(url)
        try:
            return self.filenames.index(name)
        except ValueError:
            raise FileNotFoundError(
                f"{url}: {self.url} names no chunk {name!r} (a chunk of another dataset?)"
            ) from None


def index_url(chunk: str) -> str:
    """The ``index.json`` beside the chunk file ``chunk``."""
    return posixpath.join(posixpath.dirname(chunk), INDEX_NAME)


def chunk_urls(index: LitDataIndex) -> list[str]:
    """The urls of ``index``'s chunk files, in its order."""
    directory = posixpath.dirname(index.url)
    return [posixpath.join(directory, name) for name in index.filenames]


def parse_index(data: bytes, url: str) -> LitDataIndex:
    """``index.json``'s bytes, checked: every chunk with a count, leaves this reader decodes, no pickle.

    Raises:
        ShardkitError: the file is not a LitData index, or its samples cannot be read without running code.
    """
    try:
        doc = json.loads(data)
        chunks, config = doc["chunks"], doc["config"]
        filenames = tuple(str(c["filename"]) for c in chunks)
        items = tuple(_count(c["chunk_size"]) for c in chunks)
        tokens = tuple(None if c.get("dim") is None else _count(c["dim"]) for c in chunks)
        leaves = tuple(str(f) for f in config["data_format"] or ())
    except (ValueError, KeyError, TypeError) as error:
        raise ShardkitError(f"{url} is not a LitData index ({type(error).__name__}: {error})") from None
    if any("/" in f or f in ("", ".", "..") for f in filenames):
        raise ShardkitError(f"{url} names a chunk outside its directory: {filenames}")
    _check_config(config, leaves, url)
    tokens_loader = config.get("item_loader") == "TokensLoader"
    spec = parse_spec(config.get("data_spec"), url)
    if not tokens_loader and leaf_count(spec) != len(leaves):
        raise ShardkitError(f"{url}: its data_spec has {leaf_count(spec)} leaves, its data_format {len(leaves)}")
    if tokens_loader and (len(leaves) != 1 or leaves[0].split(":")[0] not in ("no_header_numpy", "no_header_tensor")):
        raise ShardkitError(f"{url}: a TokensLoader dataset holds one token array per item, not {list(leaves)}")
    return LitDataIndex(url, filenames, items, tokens, leaves, spec, config.get("compression"), tokens_loader)


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 32:
        raise ValueError(f"a count must be an int in [0, 2**32), got {value!r}")
    return value


def _check_config(config: dict[str, Any], leaves: tuple[str, ...], url: str) -> None:
    """Refuse what cannot be read without running code, or is not read here, naming it and the way out."""
    names = [leaf.split(":")[0] for leaf in leaves]
    if "pickle" in names:
        raise ShardkitError(
            f"{url}: leaf {names.index('pickle')} of its samples is pickled (LitData's fallback for objects it has "
            "no serializer for); unpickling runs code, so shardkit does not: optimize those values as ints, "
            "floats, strings, bytes or arrays"
        )
    unknown = sorted(set(names) - set(LEAVES))
    if unknown:
        raise ShardkitError(f"{url}: serializers {unknown} are not read by shardkit; it reads {list(LEAVES)}")
    if config.get("encryption"):
        raise ShardkitError(f"{url}: its chunks are encrypted; shardkit reads unencrypted LitData chunks")
    level = config.get("compression_level")
    if config.get("compression") not in (None, "zstd") or (config.get("compression") and level not in (None, "chunk")):
        raise ShardkitError(
            f"{url}: compression {config.get('compression')!r} at level {level!r} is not read by shardkit; "
            "it reads uncompressed chunks and whole-chunk zstd (optimize with compression_level='chunk')"
        )
