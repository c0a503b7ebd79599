"""LitData's leaf serializers and sample trees, decoded: each leaf from its documented byte layout, the
tree from its JSON (dicts, lists and tuples), never by importing a type it names or unpickling."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np

from shardkit.errors import ShardkitError

__all__ = ["LEAVES", "NUMPY_DTYPES", "TORCH_DTYPES", "builder", "leaf_count", "leaf_decoder", "parse_spec"]

NUMPY_DTYPES: Final = (
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bool",
)  # fmt: skip
"""LitData's numpy dtype codes (``_NUMPY_DTYPES_MAPPING``): the code is the position; object,
bytes, str and void (14..17) are not plain data and are refused."""

TORCH_DTYPES: Final = (
    "float32", "float32", "float64", "float64", "complex64", "complex64", "complex128", "complex128",
    "float16", "float16", "bfloat16", "uint8", "int8", "int16", "int16", "int32", "int32", "int64",
    "int64", "bool", "uint16",
)  # fmt: skip
"""LitData's torch dtype codes (``_TORCH_DTYPES_MAPPING``), by position, as torch dtype names."""

LEAVES: Final = ("int", "float", "bool", "str", "text", "bytes", "numpy", "no_header_numpy", "tensor",
                 "no_header_tensor", "pil", "jpeg", "image", "json")  # fmt: skip
"""The LitData serializers read here (a ``data_format`` entry's name before any ``:``). A ``json`` leaf
(a list or dict in a sample) is read from the chunk's Arrow footer, which LitData writes beside it."""


# --------------------------------------------------------------------------- the sample tree


def parse_spec(text: Any, url: str) -> Any:
    """``data_spec`` (LitData's pytree JSON) as nested ``("dict", keys, children)``, ``("list"|"tuple", None,
    children)`` or None for a leaf."""
    if text is None:
        return None
    try:
        protocol, schema = json.loads(text)
        if protocol != 1:
            raise ValueError(f"pytree protocol {protocol}, not 1")
        return _node(schema, 0)
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ShardkitError(f"{url}: its data_spec cannot be read ({type(error).__name__}: {error})") from None


_KINDS: Final = {
    "builtins.dict": "dict",
    "collections.OrderedDict": "dict",
    "builtins.list": "list",
    "builtins.tuple": "tuple",
}


def _node(schema: dict[str, Any], depth: int) -> Any:
    if depth > 64:
        raise ValueError("the sample tree is nested more than 64 deep")
    kind = schema["type"]
    if kind is None:
        return None
    if kind not in _KINDS:
        raise ValueError(f"a {kind} in the sample tree: shardkit rebuilds dicts, lists and tuples only")
    children = [_node(child, depth + 1) for child in schema["children_spec"]]
    keys = json.loads(schema["context"]) if _KINDS[kind] == "dict" else None
    if keys is not None and (not isinstance(keys, list) or len(keys) != len(children)):
        raise ValueError(f"a dict of {len(children)} values has keys {keys!r}")
    return (_KINDS[kind], keys, children)


def leaf_count(spec: Any) -> int:
    return 1 if spec is None else sum(leaf_count(child) for child in spec[2])


def _build(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec is None:
        return next(leaves)
    kind, keys, children = spec
    values = [_build(child, leaves) for child in children]
    if kind == "dict":
        return dict(zip(keys, values))
    return values if kind == "list" else tuple(values)


def builder(spec: Any) -> Callable[[list[Any]], Any]:
    """``build(leaves)``: the sample tree of ``spec`` around its decoded leaves; a flat dict (the usual
    sample) without walking the tree."""
    if spec is None:
        return lambda leaves: leaves[0]
    kind, keys, children = spec
    if kind == "dict" and all(child is None for child in children):
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: _build(spec, iter(leaves))


# --------------------------------------------------------------------------- leaves


def torch_dtype(code: int) -> Any:
    import torch

    return getattr(torch, TORCH_DTYPES[code])


def numpy_dtype(code: int) -> np.dtype:
    return np.dtype(NUMPY_DTYPES[code])


def _array(data: memoryview, dtype: Any, shape: Sequence[int]) -> np.ndarray:
    count = math.prod(shape)
    if count * dtype.itemsize != len(data):
        raise ValueError(f"{len(data)} bytes do not hold {tuple(shape)} of {dtype}")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape).copy()


def _numpy(data: memoryview) -> np.ndarray:
    code, ndim = struct.unpack_from("<II", data)
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    return _array(data[8 + 4 * ndim :], numpy_dtype(code), shape)


def _tensor(data: memoryview) -> Any:
    import torch

    code, ndim = struct.unpack_from(">II", data)
    shape = struct.unpack_from(f">{ndim}I", data, 8)
    dtype = torch_dtype(code)
    return torch_of(data[8 + 4 * ndim :], dtype, shape) if len(data) > 8 + 4 * ndim else torch.empty(shape, dtype=dtype)


def torch_of(data: memoryview, dtype: Any, shape: Sequence[int]) -> Any:
    import torch

    if not len(data):  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype).reshape(tuple(shape))
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(shape))


def _pil(data: memoryview) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ShardkitError(
            "this LitData dataset holds PIL images: reading them needs Pillow (pip install pillow)"
        ) from None
    width, height, size = struct.unpack_from("<III", data)
    mode = bytes(data[12 : 12 + size]).decode("utf-8")
    return Image.frombytes(mode, (width, height), bytes(data[12 + size :]))


def _decoded_image(data: memoryview) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ShardkitError("images='pil' decodes images with Pillow: pip install pillow") from None
    import io

    image = Image.open(io.BytesIO(bytes(data)))
    image.load()
    return image


def leaf_decoder(leaf: str, images: str) -> Callable[[memoryview], Any]:
    """How a leaf of the ``data_format`` entry ``leaf`` decodes from its bytes."""
    name, _, arg = leaf.partition(":")
    simple: dict[str, Callable[[memoryview], Any]] = {
        "int": lambda b: struct.unpack("<q", b)[0],
        "float": lambda b: struct.unpack("<d", b)[0],
        "bool": lambda b: b[0] != 0,
        "str": lambda b: bytes(b).decode("utf-8"),
        "text": lambda b: bytes(b).decode("utf-8"),
        "bytes": bytes,
        "numpy": _numpy,
        "tensor": _tensor,
        "pil": _pil,
        "jpeg": _decoded_image if images == "pil" else bytes,
        "image": _decoded_image if images == "pil" else bytes,
    }
    if name in simple:
        return simple[name]
    if name == "no_header_numpy":
        dtype = numpy_dtype(int(arg))
        return lambda b: _array(b, dtype, (len(b) // dtype.itemsize,))
    if name == "no_header_tensor":
        dtype = torch_dtype(int(arg))
        return lambda b: torch_of(b, dtype, (-1,))
    if name == "json":
        return _no_footer
    raise ShardkitError(f"no decoder for LitData leaf {leaf!r}")


def _no_footer(data: memoryview) -> Any:
    raise ValueError("a json leaf is read from the chunk's Arrow footer, and this chunk has none")
