"""shardkit.loader.collate: slices of collated micro-batches joined into exactly what
default_collate makes of their samples, and in memory of their own when asked."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from shardkit.loader.collate import collated_length, concat, join, own_memory, same_mapping_type, tail
from tests.helpers.examples import examples
from tests.helpers.reading import assert_same


class Point(NamedTuple):
    xy: torch.Tensor
    label: int


def sample(index: int) -> dict[str, Any]:
    """A sample holding every kind of leaf default_collate handles, nested."""
    return OrderedDict(
        index=index,
        ratio=index / 7,
        flag=index % 2 == 0,
        image=torch.full((2, 3), index % 251, dtype=torch.uint8),
        half=torch.arange(3, dtype=torch.bfloat16) * index,
        array=np.array([index, -index], dtype=np.int16),
        scalar=np.float32(index / 3),
        name=f"s{index}",
        blob=bytes([index % 256]) * (index % 4),
        point=Point(torch.tensor([float(index), 1.5]), index * 10),
        nested={"pair": (index, f"p{index}"), "list": [torch.tensor(index), np.int64(-index)]},
    )


def micro_batches(samples: list[Any], sizes: list[int]) -> list[Any]:
    """``samples`` cut into consecutive micro-batches of ``sizes``, each default_collated."""
    out, start = [], 0
    for size in sizes:
        out.append(default_collate(samples[start : start + size]))
        start += size
    assert start == len(samples)
    return out


def test_whole_micro_batches_join_into_default_collate_of_all_samples_byte_for_byte() -> None:
    samples = [sample(i) for i in range(10)]
    parts = [(batch, 0, n) for batch, n in zip(micro_batches(samples, [3, 4, 3]), [3, 4, 3])]
    assert_same(join(parts), default_collate(samples))


def test_ragged_slices_of_micro_batches_join_in_order() -> None:
    samples = [sample(i) for i in range(12)]
    first, second, third = micro_batches(samples, [5, 4, 3])
    # samples 2..4, 5, and 10..11: a cut micro-batch, one sample, a tail
    joined = join([(first, 2, 5), (second, 0, 1), (third, 1, 3)])
    assert_same(joined, default_collate(samples[2:6] + samples[10:12]))


@settings(max_examples=examples(60), deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    data=st.data(),
)
def test_any_cut_of_any_micro_batches_is_default_collate_of_the_samples_it_names(sizes: list[int], data: Any) -> None:
    samples = [sample(i) for i in range(sum(sizes))]
    batches = micro_batches(samples, sizes)
    parts, names, first = [], [], 0
    for batch, size in zip(batches, sizes):
        start = data.draw(st.integers(0, size - 1))
        stop = data.draw(st.integers(start + 1, size))
        parts.append((batch, start, stop))
        names += range(first + start, first + stop)
        first += size
    assert_same(join(parts), default_collate([samples[i] for i in names]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_large_tensors_join_exactly_through_numpy_or_torch(dtype: torch.dtype) -> None:
    # 3x64x64 per sample: above the size where concat copies through numpy (bfloat16 falls back to torch).
    generator = torch.Generator().manual_seed(0)
    images = [(torch.rand(3, 64, 64, generator=generator) * 200).to(dtype) for _ in range(9)]
    parts = [(torch.stack(images[:4]), 1, 4), (torch.stack(images[4:]), 0, 5)]
    assert_same(join(parts), torch.stack(images[1:]))


def test_concat_of_one_tensor_is_a_copy() -> None:
    for rows in (2, 2000):  # below and above the serial-copy size
        tensor = torch.arange(rows * 20, dtype=torch.int32).reshape(rows, 20)
        copied = concat([tensor])
        assert torch.equal(copied, tensor) and copied.data_ptr() != tensor.data_ptr()


def test_strings_and_bytes_stay_as_default_collate_keeps_them() -> None:
    words = [f"w{i}" for i in range(6)]
    assert join([(default_collate(words[:4]), 1, 4), (default_collate(words[4:]), 0, 2)]) == words[1:]
    pairs = [(f"a{i}", f"b{i}".encode()) for i in range(5)]
    joined = join([(default_collate(pairs[:2]), 0, 2), (default_collate(pairs[2:]), 0, 3)])
    assert_same(joined, default_collate(pairs))  # a list of tuples, from zip
    assert joined == [tuple(f"a{i}" for i in range(5)), tuple(f"b{i}".encode() for i in range(5))]


def test_mapping_types_are_kept_where_default_collate_keeps_them() -> None:
    ordered = [OrderedDict(b=torch.tensor(i), a=i) for i in range(4)]
    joined = join([(default_collate(ordered[:2]), 0, 2), (default_collate(ordered[2:]), 0, 2)])
    assert type(joined) is OrderedDict and list(joined) == ["b", "a"]
    assert_same(joined, default_collate(ordered))
    frozen = MappingProxyType({"x": torch.arange(3)})
    assert same_mapping_type(frozen, {"x": 1}) == {"x": 1}  # cannot be copied and updated: a dict


class Strange:
    pass


def test_a_payload_that_is_not_default_collate_output_is_refused_naming_its_type_and_the_fix() -> None:
    with pytest.raises(TypeError, match="cannot join micro-batches of type Strange.*pass a collate_fn"):
        join([(Strange(), 0, 1)])


# -- memory ownership -------------------------------------------------------------


def slab_batch(slab: torch.Tensor, rows: int) -> dict[str, Any]:
    """A collated micro-batch whose tensors are views of ``slab``, as the slab transport delivers them."""
    images = slab[: rows * 12].view(rows, 12)
    labels = slab[rows * 12 : rows * 13].view(torch.uint8)
    return {"image": images, "label": labels}


def test_a_batch_joined_with_copy_does_not_alias_a_slab_that_is_written_again() -> None:
    slab = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for parts in ([(None, 0, 4)], [(None, 1, 3)], [(None, 0, 2), (None, 2, 4)]):
        batch = slab_batch(slab, 4)
        joined = join([(batch, a, b) for _, a, b in parts], copy=True)
        expected = own_memory(join([(batch, a, b) for _, a, b in parts]))
        slab.fill_(255)  # the worker writes its next micro-batch into the slot
        assert_same(joined, expected)
        assert not torch.equal(joined["image"], torch.full_like(joined["image"], 255))
        slab.copy_(torch.arange(256, dtype=torch.int32).to(torch.uint8))


def test_without_copy_a_whole_part_is_the_slab_itself_so_the_copy_flag_matters() -> None:
    slab = torch.zeros(64, dtype=torch.uint8)
    joined = join([(slab_batch(slab, 4), 0, 4)])
    slab.fill_(7)
    assert joined["image"].eq(7).all()  # a view: this is what copy=True exists for


def test_a_tail_owns_only_its_own_samples() -> None:
    batch = default_collate([sample(i) for i in range(8)])
    cut = tail(batch, 5, 8, collated=True)
    assert_same(cut, default_collate([sample(i) for i in range(5, 8)]))
    for name in ("image", "half", "array"):
        kept = cut[name]
        assert kept.untyped_storage().nbytes() == kept.nbytes  # not the whole micro-batch's storage
        assert kept.data_ptr() != batch[name][5:].data_ptr()
    batch["image"].fill_(0)
    assert cut["image"].flatten()[0] == 5
    samples = [sample(i) for i in range(8)]
    assert tail(samples, 6, 8, collated=False) == samples[6:]


def test_own_memory_copies_every_tensor_and_keeps_the_structure() -> None:
    value = {"t": torch.arange(3), "p": Point(torch.ones(2), 1), "l": [torch.zeros(1), ("s", torch.ones(1))]}
    copied = own_memory(value)
    assert_same(copied, value)

    def tensors(v: Any) -> Iterator[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, Mapping):
            for item in v.values():
                yield from tensors(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                yield from tensors(item)

    for original, copy in zip(tensors(value), tensors(copied), strict=True):
        assert original.data_ptr() != copy.data_ptr()


def test_collated_length_reads_what_join_reads_and_refuses_disagreeing_parts() -> None:
    plain = [{k: v for k, v in sample(i).items() if k != "point"} for i in range(3)]  # states hold no named tuples
    assert collated_length(default_collate(plain)) == 3
    assert collated_length({"a": torch.zeros(4, 2), "b": ["x", "y", "z", "w"]}) == 4
    assert collated_length({"a": torch.zeros(4), "b": torch.zeros(3)}) is None
    assert collated_length(torch.tensor(3)) is None
    assert collated_length("abc") is None
