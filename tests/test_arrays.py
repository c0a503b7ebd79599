"""shardkit.arrays: a column's values and validity read from its buffers equal pyarrow's own conversion,
for nulls anywhere, sliced chunks (a bit offset inside a byte) and any chunking."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.arrays import int64_values, valid_mask
from tests.helpers.examples import examples

VALUES = st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=40)


@st.composite
def columns(draw: st.DrawFn) -> pa.ChunkedArray:
    """A ChunkedArray of int64 whose chunks may be slices starting at any bit of their bitmap."""
    chunks = []
    for values in draw(st.lists(VALUES, max_size=4)):
        whole = pa.array(values, type=pa.int64())
        start = draw(st.integers(0, len(whole)))
        chunks.append(whole.slice(start, draw(st.integers(0, len(whole) - start))))
    return pa.chunked_array(chunks, type=pa.int64())


@settings(max_examples=examples(300), deadline=None)
@given(columns(), st.integers(-5, 5))
def test_values_and_validity_equal_pyarrows_own_conversion(column: pa.ChunkedArray, fill: int) -> None:
    expected_valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    assert valid_mask(column).tolist() == expected_valid.tolist()
    values = int64_values(column, fill)
    assert values.dtype == np.int64
    assert values.tolist() == [fill if v is None else v for v in column.to_pylist()]


@pytest.mark.parametrize("make", [lambda: pa.nulls(5, pa.int64()), lambda: pa.array([None, 3, None], pa.int64())])
def test_an_array_is_read_as_its_own_one_chunk(make) -> None:
    array = make()
    assert valid_mask(array).tolist() == [v is not None for v in array.to_pylist()]
    assert int64_values(array, -1).tolist() == [-1 if v is None else v for v in array.to_pylist()]


def test_one_chunk_without_nulls_is_a_read_only_view_of_its_buffer() -> None:
    column = pa.chunked_array([pa.array(np.arange(6, dtype=np.int64))]).slice(2)
    values = int64_values(column)
    assert values.tolist() == [2, 3, 4, 5] and not values.flags.writeable and values.base is not None


def test_another_integer_type_is_converted_by_pyarrow() -> None:
    column = pa.chunked_array([pa.array([1, None, 3], pa.int32())])
    assert int64_values(column, 7).tolist() == [1, 7, 3] and valid_mask(column).tolist() == [True, False, True]
