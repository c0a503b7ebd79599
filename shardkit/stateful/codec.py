"""Samples in saved states as plain data: a tagged tree of JSON values, never pickled.

:func:`encode` turns a sample into data that ``json`` and
``torch.load(weights_only=True)`` can hold; :func:`decode` builds only the
types listed there, so loading a state never runs code. Numpy generator
positions (saved by :func:`shardkit.seeding.generator_state`) are checked
and rebuilt here too.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardkit.errors import StateError

# -- samples as plain data --------------------------------------------------------
#
# Samples are saved as a tagged tree of JSON values, never pickled: decoding
# builds only the types below, so loading a state cannot run code. str, int,
# bool, None and finite floats stand for themselves; everything else is a
# list whose first item names the type.

_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937")

#: Deepest nesting of lists, tuples and dicts in a saved sample.
MAX_DEPTH = 64

_ARRAY_KINDS = "biufcSUmM"  # numpy dtype kinds with no Python objects inside
_NUMPY_DTYPE = re.compile(r"[<>|=][biufcSUmM]\d{1,6}(\[[A-Za-z0-9]{1,6}\])?")
_TENSOR_DTYPES = {
    name: dtype
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}  # fmt: skip
_KEY_TYPES = (str, int, float, bool, bytes, type(None))
_ALLOWED = (
    "tensors, numpy arrays and scalars (not of object or structured dtype), str, bytes, int, float, "
    "bool, None, and lists, tuples and dicts of them"
)


class _Unsavable(Exception):
    """A value :func:`encode` cannot hold; ``path`` grows as the error unwinds."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = ""


def encode(value: Any) -> Any:
    """``value`` (a sample) as plain data: JSON-able and loadable by
    ``torch.load(weights_only=True)``; :func:`decode` turns it back.

    Holds tensors (CPU, dense; values, dtype and shape), numpy arrays and
    scalars of non-object dtypes, str, bytes, int, float, bool, None and lists,
    tuples and dicts (exactly these types; dict keys scalars) of them.

    Raises:
        StateError: for anything else (another class, a dict subclass or
            namedtuple, an object array), naming the type and where it is.
    """
    try:
        return _encode(value, 0)
    except _Unsavable as error:
        where = f" at sample{error.path}" if error.path else ""
        raise StateError(
            f"cannot save a sample in a state: {error.reason}{where}. A state holds only {_ALLOWED}, "
            "so that loading it never runs code. Map samples to such types before .shuffle() "
            "(or before MixedLoader batches them), or pass resumable=False to MixedLoader "
            "when you do not resume"
        ) from None


def _encode(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        return value if math.isfinite(value) else ["float", repr(value)]
    if kind is bytes:
        return ["bytes", _b64(value)]
    if kind is list or kind is tuple or kind is dict:
        if depth >= MAX_DEPTH:
            raise _Unsavable(f"samples nest deeper than {MAX_DEPTH} lists, tuples and dicts")
        return _encode_container(value, depth + 1)
    if kind is np.ndarray or isinstance(value, np.generic):
        return _encode_array(value)
    if kind is torch.Tensor:
        return _encode_tensor(value)
    raise _Unsavable(f"{_type_name(value)} is not one of these types")


def _encode_container(value: Any, depth: int) -> list[Any]:
    items = value.items() if type(value) is dict else enumerate(value)
    out: list[Any] = [type(value).__name__]
    for key, item in items:
        try:
            if type(value) is dict:
                if type(key) not in _KEY_TYPES:
                    raise _Unsavable(
                        f"a dict key of type {_type_name(key)} (keys must be str, int, float, bool, bytes or None)"
                    )
                out.append(_encode(key, depth))
            out.append(_encode(item, depth))
        except _Unsavable as error:
            error.path = f"[{key!r}]{error.path}"
            raise
    return out


def _encode_array(value: np.ndarray | np.generic) -> list[Any]:
    dtype = value.dtype
    if dtype.kind not in _ARRAY_KINDS or dtype.hasobject or not _NUMPY_DTYPE.fullmatch(dtype.str):
        raise _Unsavable(
            f"a numpy {type(value).__name__} of dtype {dtype} (object and structured dtypes can hold code)"
        )
    data = _b64(np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return ["numpy", dtype.str, data]
    return ["ndarray", dtype.str, list(value.shape), data]


def _encode_tensor(value: torch.Tensor) -> list[Any]:
    name = str(value.dtype).removeprefix("torch.")
    if name not in _TENSOR_DTYPES or value.layout != torch.strided or value.device.type != "cpu":
        raise _Unsavable(
            f"a tensor of dtype {name}, layout {value.layout}, device {value.device} "
            "(only dense CPU tensors of plain dtypes are saved)"
        )
    flat = value.detach().resolve_conj().resolve_neg().contiguous().view(-1)
    # Raw bytes in this machine's order; every platform torch supports is little-endian.
    return ["tensor", name, list(value.shape), _b64(flat.view(torch.uint8).numpy().tobytes())]


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(data: Any) -> Any:
    """The sample :func:`encode` made ``data`` from. Builds only the types
    :func:`encode` holds, so a crafted state cannot run code.

    Raises:
        StateError: ``data`` is not such an encoding (naming what is wrong and where).
    """
    try:
        return _decode(data, 0)
    except (ValueError, RuntimeError) as error:  # a reshape numpy or torch refuses
        raise StateError(f"the state holds a sample that cannot be read: {error}") from None
    except _Unsavable as error:
        where = f" at sample{error.path}" if error.path else ""
        raise StateError(f"the state holds a sample that cannot be read: {error.reason}{where}") from None


def _decode(data: Any, depth: int) -> Any:
    kind = type(data)
    if kind is str or kind is int or kind is bool or kind is float or data is None:
        return data
    if kind is not list or not data or type(data[0]) is not str:
        raise _Unsavable(f"{_type_name(data)} {short(data)} is not an encoded sample")
    tag = data[0]
    if tag in ("list", "tuple", "dict"):
        if depth >= MAX_DEPTH:
            raise _Unsavable(f"lists, tuples and dicts nest deeper than {MAX_DEPTH}")
        return _decode_container(data, depth + 1)
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise _Unsavable(f"unknown type tag {short(tag)}")
    return decoder(data)


def _decode_container(data: list[Any], depth: int) -> Any:
    tag, items = data[0], data[1:]
    if tag != "dict":
        values = []
        for index, item in enumerate(items):
            try:
                values.append(_decode(item, depth))
            except _Unsavable as error:
                error.path = f"[{index}]{error.path}"
                raise
        return values if tag == "list" else tuple(values)
    if len(items) % 2:
        raise _Unsavable("a dict with a key but no value")
    out = {}
    for index in range(0, len(items), 2):
        key = _decode(items[index], depth)
        if type(key) not in _KEY_TYPES:
            raise _Unsavable(f"a dict key of type {_type_name(key)}")
        try:
            out[key] = _decode(items[index + 1], depth)
        except _Unsavable as error:
            error.path = f"[{key!r}]{error.path}"
            raise
    return out


def _decode_float(data: list[Any]) -> float:
    if data[1:] not in (["nan"], ["inf"], ["-inf"]):
        raise _Unsavable(f"a float {short(data[1:])} (only 'nan', 'inf' and '-inf' are tagged)")
    return float(data[1])


def _decode_bytes(data: list[Any]) -> bytes:
    _expect_fields(data, str)
    return _unb64(data[1])


def _decode_numpy(data: list[Any]) -> Any:
    _expect_fields(data, str, str)
    dtype = _numpy_dtype(data[1])
    raw = _unb64(data[2])
    if len(raw) != dtype.itemsize:
        raise _Unsavable(f"a numpy scalar of dtype {dtype} with {len(raw)} bytes")
    return np.frombuffer(raw, dtype)[0]


def _decode_ndarray(data: list[Any]) -> np.ndarray:
    _expect_fields(data, str, list, str)
    dtype, shape, raw = _numpy_dtype(data[1]), _shape(data[2]), _unb64(data[3])
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise _Unsavable(f"an array of shape {shape} and dtype {dtype} with {len(raw)} bytes")
    return np.frombuffer(bytearray(raw), dtype).reshape(shape)


def _decode_tensor(data: list[Any]) -> torch.Tensor:
    _expect_fields(data, str, list, str)
    dtype = _TENSOR_DTYPES.get(data[1])
    if dtype is None:
        raise _Unsavable(f"a tensor of unknown dtype {short(data[1])}")
    shape, raw = _shape(data[2]), _unb64(data[3])
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise _Unsavable(f"a tensor of shape {shape} and dtype {data[1]} with {len(raw)} bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _expect_fields(data: list[Any], *types: type) -> None:
    if len(data) != len(types) + 1 or any(type(v) is not t for v, t in zip(data[1:], types)):
        expected = ", ".join(t.__name__ for t in types)
        raise _Unsavable(f"a {data[0]!r} entry must hold ({expected}), got {short(data[1:])}")


def _numpy_dtype(text: str) -> np.dtype:
    if not _NUMPY_DTYPE.fullmatch(text):
        raise _Unsavable(f"numpy dtype {short(text)} (only plain numbers, strings and dates)")
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise _Unsavable(f"numpy dtype {short(text)}") from None
    if dtype.itemsize == 0 or dtype.hasobject:
        raise _Unsavable(f"numpy dtype {short(text)}")
    return dtype


def _shape(shape: list[Any]) -> tuple[int, ...]:
    if len(shape) > 32 or any(type(n) is not int or n < 0 for n in shape):
        raise _Unsavable(f"shape {short(shape)} (up to 32 non-negative ints)")
    return tuple(shape)


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise _Unsavable(f"invalid base64 {short(text)}") from None


_DECODERS: dict[str, Callable[[list[Any]], Any]] = {
    "float": _decode_float,
    "bytes": _decode_bytes,
    "numpy": _decode_numpy,
    "ndarray": _decode_ndarray,
    "tensor": _decode_tensor,
}


def restore_generator(state: dict[str, Any], where: str = "state") -> np.random.Generator:
    """A numpy generator at the position :func:`shardkit.seeding.generator_state` saved.

    Raises:
        StateError: ``state`` is not the state of a numpy bit generator.
    """
    name = state.get("bit_generator")
    if name not in _BIT_GENERATORS:
        known = ", ".join(_BIT_GENERATORS)
        raise StateError(f"{where}: unknown bit generator {short(name)} in the state; known: {known}")
    bit_generator = getattr(np.random, name)()
    try:
        bit_generator.state = state
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as error:
        raise StateError(f"{where}: the saved {name} generator state is not valid: {error}") from None
    if not same_data(state, bit_generator.state):  # numpy accepts some stand-ins (True for 1, extra keys)
        raise StateError(f"{where}: the saved {name} generator state is not one numpy writes: {short(state)}")
    return np.random.Generator(bit_generator)


def same_data(saved: object, actual: object) -> bool:
    """Equal plain data of equal types, lists and tuples alike (JSON keeps no tuples)."""
    if isinstance(actual, np.generic):  # a numpy number computed here is saved as its Python value
        actual = actual.item()
    if isinstance(actual, (list, tuple)):
        return (
            type(saved) in (list, tuple)
            and len(saved) == len(actual)  # type: ignore[arg-type]
            and all(map(same_data, saved, actual))  # type: ignore[call-overload]
        )
    if isinstance(actual, dict):
        return (
            type(saved) is dict
            and saved.keys() == actual.keys()
            and all(same_data(saved[key], value) for key, value in actual.items())
        )
    return type(saved) is type(actual) and saved == actual


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
