"""Fault tests for saved states: loading one never runs code, and a tampered one
is a StateError naming the field, never a KeyError, a TypeError or an epoch that
silently ends early.

Mutations are applied to real states, saved by StatefulDataLoader (torchdata)
and MixedLoader over pipelines with every kind of stage; hypothesis picks the
field and the change.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import math
import re
from collections import Counter, OrderedDict, namedtuple
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from shardkit import MixedLoader, Schedule, ShardedDataset, interleave, wrap
from shardkit.pipeline import Pipeline, Shuffle
from shardkit.state import StateError, decode, encode, merge, merge_ranks
from shardkit.stateful.protocol import _STAGES  # pyright: ignore[reportPrivateUsage]
from tests.helpers.examples import examples
from tests.helpers.reading import CountingStream, read_all
from tests.helpers.shards import synthetic_read, synthetic_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning", "ignore:'set_vital'")

COUNTS = [7, 13, 5, 20, 9, 31, 4]  # 89 records
TOTAL = sum(COUNTS)


def source(**kwargs: Any) -> ShardedDataset:
    return ShardedDataset(synthetic_shards(COUNTS), synthetic_read, **{"shuffle": True, "seed": 5, **kwargs})


def _only(items: list[Any]) -> Any:
    return items[0]


def by_data(**kwargs: Any) -> Pipeline:
    """:func:`source` as one-sample batches: a shuffle over it cannot read its items again by position
    (``records()`` of a batch is None), so it saves its buffered samples themselves, encoded."""
    return source(**kwargs).batch(1, collate_fn=_only)


def _odd(item: Any) -> bool:
    return item % 2 == 1 if isinstance(item, int) else True


def _shout(sample: Any) -> Any:
    """Upper-case a text sample; others (a tampered state may plant them) pass as they are."""
    return sample.upper() if isinstance(sample, str) else sample


def every_kind() -> Pipeline:
    """planned, stream, map, filter, shuffle, interleave, repeat and batch stages."""
    planned = Shuffle(source(), 5).map(_shout)
    stream = wrap(CountingStream(30)).filter(_odd)
    return interleave([planned, stream], weights=[2, 1], seed=3, stop="all_exhausted").repeat(2).batch(3, list)


def roundtrip(state: Any) -> Any:
    return json.loads(json.dumps(state))


def torch_roundtrip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def nodes(tree: Any, kind: str) -> list[dict[str, Any]]:
    """Every state node of ``kind`` in ``tree`` (a loader's state or a pipeline's)."""
    found = []
    if isinstance(tree, dict):
        if tree.get("kind") == kind:
            found.append(tree)
        for value in tree.values():
            found += nodes(value, kind)
    elif isinstance(tree, list):
        for value in tree:
            found += nodes(value, kind)
    return found


# -- no pickle --------------------------------------------------------------------


class CreatesFile:
    """Unpickling this calls ``open(path, "w")``: code run by loading a state."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (self.path, "w")


def pickled(path: Path) -> str:
    """What shardkit used to store for a shuffle buffer or a carried tail, carrying the payload."""
    buffer = io.BytesIO()
    torch.save([CreatesFile(path)], buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_the_payload_runs_code_when_unpickled(tmp_path: Path) -> None:
    """The control: the payload the other tests plant does create its file when unpickled."""
    target = tmp_path / "control"
    torch.load(io.BytesIO(base64.b64decode(pickled(target))), weights_only=False)
    assert target.exists()


def shuffle_checkpoint() -> tuple[dict[str, Any], list[Any]]:
    """A StatefulDataLoader state mid-epoch over a shuffle buffer, and the samples delivered before it."""
    loader = StatefulDataLoader(Shuffle(by_data(), 10), batch_size=None, num_workers=0)
    iterator = iter(loader)
    delivered = [next(iterator) for _ in range(7)]
    return loader.state_dict(), delivered


@pytest.mark.parametrize(
    "plant, error",
    [
        ("old buffer", "pickled .*unpickling can run code"),
        ("unknown tag", "unknown type tag 'pickle'"),
        ("object array", "numpy dtype '|O8'"),
        ("as bytes", None),  # read as the bytes they are: a sample, not code
        ("as text", None),
    ],
)
def test_a_pickle_planted_in_a_shuffle_state_runs_no_code(tmp_path: Path, plant: str, error: str | None) -> None:
    target = tmp_path / "owned"
    payload = pickled(target)
    state, _ = shuffle_checkpoint()
    shuffle = nodes(state, "shuffle")[0]
    if plant == "old buffer":
        del shuffle["samples"]
        shuffle["buffer"] = [payload]
    else:
        planted = {
            "unknown tag": ["pickle", payload],
            "object array": ["ndarray", "|O8", [1], payload],
            "as bytes": ["bytes", payload],
            "as text": payload,
        }[plant]
        shuffle["samples"][0] = planted
    # The checkpoint passes torch.load(weights_only=True): it is plain data either way.
    checkpoint = torch_roundtrip(roundtrip(state))
    loader = StatefulDataLoader(Shuffle(by_data(), 10), batch_size=None, num_workers=0)
    if error is None:
        loader.load_state_dict(checkpoint)
        rest = list(loader)
        assert rest.count(base64.b64decode(payload) if plant == "as bytes" else payload) == 1
    else:
        with pytest.raises(StateError, match=error):
            loader.load_state_dict(checkpoint)
            list(loader)
    assert not target.exists()


def carrying_data() -> Pipeline:
    """The pipeline of the MixedLoader states these tests tamper with: a batch of one below its shuffle
    cannot read its items again by position, so a state carries its cut micro-batches as data, encoded,
    whose checks are tested here (the form by position: tests/loader/test_carry_positions.py)."""
    return Shuffle(by_data(), 10).map(to_record)


def mixed_loader(**kwargs: Any) -> MixedLoader:
    """Its workers keep no restart points (shardkit.loader.restart), so a save carries the data tested here."""
    loader = MixedLoader(carrying_data(), 8, num_workers=2, micro_batch_size=3, **kwargs)
    if loader._micro_batches is not None:
        loader._micro_batches.restart = False
    return loader


@cache
def mixed_checkpoint() -> str:
    """JSON of a MixedLoader state (2 workers) that carries the cut tail of a
    micro-batch, and of the number of batches delivered before it."""
    loader = mixed_loader()
    iterator = iter(loader)
    for batches in range(1, 4):
        next(iterator)
        state = loader.state_dict()
        if state["carry"]:
            return json.dumps({"state": state, "batches": batches})
    raise AssertionError("no save point cut a micro-batch")


def mixed_state() -> dict[str, Any]:
    return json.loads(mixed_checkpoint())["state"]


def to_record(sample: str) -> dict[str, Any]:
    """A sample with a string and a tensor, as default_collate batches it."""
    return {"id": sample, "x": torch.tensor([len(sample), int(sample.rsplit(":", 1)[1])])}


def test_a_pickle_planted_in_a_mixed_loader_carry_runs_no_code(tmp_path: Path) -> None:
    target = tmp_path / "owned"
    for planted in (pickled(target), ["pickle", pickled(target)], ["tensor", "float32", [1], pickled(target)]):
        state = mixed_state()
        state["carry"][0]["payload"] = planted
        with pytest.raises(StateError, match="carry|cannot be read"):
            MixedLoader(carrying_data(), 8, num_workers=2).load_state_dict(torch_roundtrip(state))
    assert not target.exists()


def test_a_mixed_loader_state_is_plain_data_that_resumes_exactly() -> None:
    """The carry holds the collated tail (strings and a tensor) as plain data; it resumes the same batches."""
    full = [batch["id"] for batch in mixed_loader()]
    saved = json.loads(mixed_checkpoint())
    payload = saved["state"]["carry"][0]["payload"]
    count = saved["state"]["carry"][0]["count"]
    assert payload[:2] == ["dict", "id"] and payload[2][0] == "list" and len(payload[2]) == 1 + count
    assert payload[3] == "x" and payload[4][:3] == ["tensor", "int64", [count, 2]]
    loader = mixed_loader()
    loader.load_state_dict(torch_roundtrip(saved["state"]))
    assert [batch["id"] for batch in loader] == full[saved["batches"] :]


SAMPLES: list[Any] = [
    b"\x00\x01raw",
    "text",
    -(2**70),
    True,
    None,
    float("nan"),
    float("-inf"),
    0.1,
    {"a": [1, (2, b"x")], 3: None, b"k": 1.5},
    np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2],
    np.float32(2.5),
    np.array(["ab", "c"]),
    np.datetime64("2024-02-29T12:00"),
    torch.arange(6, dtype=torch.int16).reshape(2, 3).t(),
    torch.ones(2, dtype=torch.bfloat16),
    torch.zeros(0, 3),
    torch.tensor([1 + 2j]),
    (torch.tensor(7), {"label": np.int64(3)}),
]


def same_sample(a: Any, b: Any) -> bool:
    """Equal in type, dtype, shape and value (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_sample, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_sample(a[k], b[k]) for k in a)
    return a == b


def test_every_supported_sample_type_comes_back_exactly_through_json_and_torch_load() -> None:
    for sample in SAMPLES:
        encoded = encode(sample)
        json.dumps(encoded, allow_nan=False)  # strict JSON: no NaN literals
        assert same_sample(decode(roundtrip(encoded)), sample), sample
        assert same_sample(decode(torch_roundtrip(encoded)), sample), sample


def test_a_shuffle_buffer_of_every_supported_type_resumes_exactly() -> None:
    def make() -> Pipeline:
        return Shuffle(wrap(SAMPLES), 8)

    full = list(make())
    for cut in (1, 5, len(SAMPLES) - 2):
        dataset = make()
        iterator = iter(dataset)
        before = [next(iterator) for _ in range(cut)]
        resumed = make()
        resumed.load_state_dict(torch_roundtrip(roundtrip(dataset.state_dict())))
        assert all(map(same_sample, before + list(resumed), full)), cut


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "sample, named",
    [
        (OrderedDict(a=1), "collections.OrderedDict"),
        (Point(1, 2), "Point"),
        ({"nested": [1, {2, 3}]}, r"set .* at sample\['nested'\]\[1\]"),
        (np.array([1, None], dtype=object), "dtype object"),
        ({(1, 2): "tuple key"}, "dict key of type tuple"),
        (torch.nn.Parameter(torch.ones(1)), "Parameter"),
        (bytearray(b"x"), "bytearray"),
    ],
)
def test_an_unsupported_sample_is_refused_when_saving_naming_its_type_and_the_fix(sample: Any, named: str) -> None:
    dataset = Shuffle(wrap(iter([sample, sample])), 4)  # a plain iterable: its samples are saved, not positions
    next(iter(dataset))
    with pytest.raises(StateError, match=f"{named}.*resumable=False"):
        dataset.state_dict()
    loader = MixedLoader(Shuffle(wrap(iter([sample] * 4)), 4), 2, collate_fn=list)
    next(iter(loader))
    with pytest.raises(StateError, match=f"{named}.*resumable=False"):
        loader.state_dict()


def test_too_deep_samples_are_refused_both_ways() -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(StateError, match="deeper than 64"):
        encode(deep)
    crafted: Any = 1
    for _ in range(10_000):  # deeper than Python's recursion limit
        crafted = ["list", crafted]
    with pytest.raises(StateError, match="deeper than 64"):
        decode(crafted)


# -- tampered states, field by field ----------------------------------------------


def saved(make: Any, steps: int) -> dict[str, Any]:
    """The state of ``make()`` (a loader or a pipeline) after ``steps`` items, through JSON."""
    loader = make()
    iterator = iter(loader)
    for _ in range(steps):
        next(iterator)
    return roundtrip(loader.state_dict())


def edit(state: dict[str, Any], kind: str, change: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    change(nodes(state, kind)[0])
    return state


def put(key: str, value: Any) -> Any:
    return lambda node: node.__setitem__(key, value)


def drop(key: str) -> Any:
    return lambda node: node.pop(key)


TAMPERED = {
    "planned: missing remaining": ("planned", drop("remaining"), "has no 'remaining'"),
    "planned: str epoch": ("planned", put("epoch", "0"), r"state\['epoch'\] must be int, got str"),
    "planned: negative epoch": ("planned", put("epoch", -1), "must be >= 0, got -1"),
    "planned: dict remaining": ("planned", put("remaining", {"0": 5}), "must be list or tuple, got dict"),
    "planned: inverted interval": ("planned", put("remaining", [[20, 10]]), r"\[20, 10\) after position 0"),
    "planned: empty interval": ("planned", put("remaining", [[10, 10]]), r"\[10, 10\)"),
    "planned: overlapping": ("planned", put("remaining", [[10, 30], [20, 40]]), r"\[20, 40\) after position 30"),
    "planned: negative start": ("planned", put("remaining", [[-5, 3]]), r"\[-5, 3\)"),
    "planned: past the chunk": ("planned", put("remaining", [[80, 90]]), "reach 90, past the end of .* chunk of 89"),
    "planned: float bound": ("planned", put("remaining", [[1, 2.5]]), "pairs of ints"),
    "planned: rank beyond world": ("planned", put("rank", 2), "rank'\\] 2 is not below"),
    "planned: bool world size": ("planned", put("world_size", True), "world_size'\\] must be int, got bool"),
    "planned: fingerprint retyped": ("planned", lambda n: n["fingerprint"].update(shuffle=1), "saved with dataset"),
    "planned: share of 3 words": ("planned", put("share", [0, 1, 2]), r"\[worker, num_workers\]"),
    "planned: share past workers": ("planned", put("share", [2, 2]), r"\[worker, num_workers\]"),
    "planned: share as text": ("planned", put("share", "0/2"), "must be None or list or tuple, got str"),
    "shuffle: missing positions": ("shuffle", drop("positions"), "either 'positions' or 'samples'"),
    "shuffle: missing identities": ("shuffle", drop("identities"), "has no 'identities'"),
    "shuffle: older than its input": ("shuffle", put("epoch", 1), "state is of epoch 1 but its inputs' of epoch 0"),
    "shuffle: draws past the block": ("shuffle", lambda n: n["rng"].update(next=5000), "must be <= 1024"),
    "shuffle: unknown generator": ("shuffle", lambda n: n["rng"]["generator"].update(bit_generator="seed"), "unknown"),
    "shuffle: generator state": ("shuffle", lambda n: n["rng"]["generator"].update(has_uint32=True), "not one numpy"),
    "shuffle: broken positions": ("shuffle", lambda n: n["positions"].__setitem__(3, "@@"), "invalid base64"),
    "shuffle: positions of floats": ("shuffle", put("positions", encode(np.zeros((2, 2)))), r"\[n, 2\] integer"),
    "map: upstream a list": ("map", put("upstream", []), r"state\['upstream'\] must be dict, got list"),
    "unknown kind": ("map", put("kind", "mystery"), "'mystery' stage but this stage is 'map'"),
    "unknown version": ("map", put("version", 3), "version 3 is not supported"),
    "version as text": ("map", put("version", "1"), "version '1' is not supported"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_field_is_a_state_error_naming_it(case: str) -> None:
    def make() -> Pipeline:
        return Shuffle(source(), 6).map(str.upper)

    kind, change, message = TAMPERED[case]
    state = edit(saved(lambda: StatefulDataLoader(make(), batch_size=None, num_workers=0), 9), kind, change)
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    with pytest.raises(StateError, match=message):
        loader.load_state_dict(state)
        list(loader)


def test_tampered_repeat_interleave_and_stream_states_are_state_errors() -> None:
    def make() -> Pipeline:
        return interleave([source(), wrap(CountingStream(30))], seed=1, stop="all_exhausted").repeat(2)

    state = saved(lambda: StatefulDataLoader(make(), batch_size=None, num_workers=0), 100)
    cases = [
        ("repeat", put("pass", 2), "in pass 2, but this repeat\\(\\) makes 2 passes"),
        ("repeat", put("upstream", None), "without an upstream state must be past a finished pass"),
        ("repeat", put("yielded", "yes"), "yielded'\\] must be bool"),
        ("interleave", lambda n: n["upstream"].__setitem__(1, None), "no state for input 1 of weight 1.0"),
        ("interleave", lambda n: n["upstream"].append(None), "the state has 3 inputs, this interleave 2"),
        ("interleave", put("live", [1, 0]), "increasing indices"),
        ("interleave", put("live", [0, 2]), "increasing indices of inputs below 2"),
        ("interleave", put("stopped", 0), "stopped'\\] must be bool"),
        ("stream", put("items", 31), "says 31 items were read, but the iterable has only 30"),
        ("stream", put("reader", [1, 1]), r"\[slot, readers\]"),
        ("stream", put("done", None), "done'\\] must be bool"),
    ]
    for kind, change, message in cases:
        loader = StatefulDataLoader(make(), batch_size=None, num_workers=0)
        with pytest.raises(StateError, match=message):
            loader.load_state_dict(edit(state, kind, change))
            list(loader)


def test_merge_refuses_tampered_worker_states() -> None:
    planned = {"version": 1, "kind": "planned", "epoch": 0, "world_size": 1, "rank": 0, "fingerprint": {}}
    workers = [{**planned, "remaining": [[w * 10, w * 10 + 5]], "share": [w, 2]} for w in range(2)]
    with pytest.raises(StateError, match="overlap"):
        merge([workers[0], {**workers[1], "remaining": [[3, 8]]}])
    with pytest.raises(StateError, match="state of worker 1: the state has no 'rank'"):
        merge([workers[0], {k: v for k, v in workers[1].items() if k != "rank"}])
    with pytest.raises(StateError, match="unknown state kind 'mystery'"):
        merge([{**workers[0], "kind": "mystery"}])
    mix = {"version": 1, "kind": "interleave", "epoch": 0, "live": [0], "rng": None, "stopped": False}
    with pytest.raises(StateError, match="different numbers of inputs"):
        merge(
            [
                {**mix, "share": [0, 2], "upstream": [workers[0]]},
                {**mix, "share": [1, 2], "upstream": [workers[1], None]},
            ]
        )


LOADER_TAMPERED = [
    (lambda s: s.pop("workers"), "has no 'workers'"),
    (lambda s: s.update(workers=s["workers"][:1]), "1 worker states for num_workers=2"),
    (lambda s: s.update(epoch=-3), "epoch'\\] must be >= 0"),
    (lambda s: s.update(batch_index="3"), "batch_index'\\] must be int"),
    (lambda s: s.update(carry={}), "carry'\\] must be list or tuple, got dict"),
    (lambda s: s["carry"][0].update(count=s["carry"][0]["count"] + 1), "collated micro-batch of"),
    (lambda s: s["carry"][0].update(worker=2), "worker 2 is not one of the saving loader's 2 workers"),
    (lambda s: s["carry"].append(copy.deepcopy(s["carry"][0])), "more than one tail"),
    (lambda s: s["carry"][0].pop("payload"), "must hold its samples as one of 'payload'"),
    (lambda s: s["workers"][0].update(kind="shuffle"), "workers'\\]\\[0\\]: the state has no 'epoch'"),
    (lambda s: s["workers"][1].update(kind="filter"), "'filter' stage but this stage is 'map'"),
]


@pytest.mark.parametrize("index", range(len(LOADER_TAMPERED)))
def test_a_tampered_mixed_loader_state_is_refused_when_loaded(index: int) -> None:
    change, message = LOADER_TAMPERED[index]
    state = mixed_state()
    change(state)
    loader = MixedLoader(carrying_data(), 8, num_workers=2)
    with pytest.raises(StateError, match=message):
        loader.load_state_dict(state)


def test_a_carry_saved_for_a_collate_fn_does_not_load_into_a_collating_loader() -> None:
    state = mixed_state()
    loader = MixedLoader(carrying_data(), 8, num_workers=2, collate_fn=list)
    with pytest.raises(StateError, match="must be a list of samples \\(for collate_fn\\)"):
        loader.load_state_dict(state)


# -- hypothesis: mutations of real states ----------------------------------------

Path_ = tuple[Any, ...]


def paths(tree: Any, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every path to a value below the root of a state tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def at(tree: Any, path: Path_) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def in_sample(path: Path_) -> bool:
    """Inside an encoded sample, where another value may still be a valid sample."""
    return any(key in ("samples", "payload") for key in path[:-1])


def may_be_none(tree: Any, path: Path_) -> bool:
    """Fields where None is also a valid value."""
    parent = at(tree, path[:-1])
    # "window": None is a merged (positions-only) state; "rank": None a global state (any world size)
    if path[-1] in ("window", "rank") and parent.get("kind") == "planned":
        return True
    return path[-1] in ("rng", "share") or (path[-1] == "upstream" and parent.get("kind") == "repeat")


REPLACEMENTS = ["x", 7, 2.5, None, True, [], {}]


@st.composite
def mutations(draw: Any, tree: Any) -> tuple[str, Path_, Any]:
    """(how, path, new value): drop a key, replace a value by one of another type, or shift an int."""
    how = draw(st.sampled_from(["drop", "retype", "shift"]))
    if how == "drop":
        return how, draw(st.sampled_from([p for p in paths(tree) if isinstance(at(tree, p[:-1]), dict)])), None
    if how == "retype":
        path = draw(st.sampled_from(list(paths(tree))))
        value = at(tree, path)
        return how, path, draw(st.sampled_from([r for r in REPLACEMENTS if type(r) is not type(value)]))
    ints = [p for p in paths(tree) if type(at(tree, p)) is int and "generator" not in p]
    path = draw(st.sampled_from(ints))
    return how, path, at(tree, path) + draw(st.sampled_from([-2, -1, 1, 2, 10**6]))


def mutate(tree: Any, how: str, path: Path_, value: Any) -> Any:
    tree = copy.deepcopy(tree)
    parent = at(tree, path[:-1])
    if how == "drop":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return tree


@cache
def every_kind_run() -> str:
    """JSON of: the whole uninterrupted run of ``every_kind()``, and StatefulDataLoader states at save points."""
    full = [s for batch in every_kind() for s in batch]
    loader = StatefulDataLoader(every_kind(), batch_size=None, num_workers=0)
    states = [roundtrip(loader.state_dict()) for count, _ in enumerate(loader, 1) if count in (1, 20, 40, 69)]
    return json.dumps({"full": full, "states": states})


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_stateful_dataloader_state_fails_cleanly_or_continues_validly(data: Any) -> None:
    """Dropped keys and retyped fields are StateErrors; where another value is
    valid (a shifted int, None where allowed, a changed sample), the run
    completes and, outside samples and positions, yields no sample more often
    than a whole run does."""
    run = json.loads(every_kind_run())
    state = data.draw(st.sampled_from(run["states"]))
    how, path, value = data.draw(mutations(state["dataset_state"]))
    tampered = {**state, "dataset_state": mutate(state["dataset_state"], how, path, value)}
    none_allowed = value is None and may_be_none(state["dataset_state"], path)
    strict = how == "drop" or (how == "retype" and not in_sample(path) and not none_allowed)
    loader = StatefulDataLoader(every_kind(), batch_size=None, num_workers=0)
    try:
        loader.load_state_dict(tampered)
        rest = [s for batch in loader for s in batch]
    except StateError:
        return
    assert not strict, f"{how} {path} -> {value!r} was accepted"
    # Shifted positions read what the state now says, which may repeat samples
    # already delivered or buffered: checked exactly by the test after this one.
    # A window saved by its start names its positions by a count yielded and
    # runs skipped: edited, they too read what the state now says.
    moved = "remaining" in path or path[-1] == "items" or "window" in path
    if not in_sample(path) and not moved:
        assert not Counter(rest) - Counter(run["full"]), f"{how} {path} -> {value!r} yields samples a run does not"


def source_in_block_order(shuffled: bool) -> ShardedDataset:
    """``source(shuffle=shuffled)`` without sample-level windows, which break "position p is sample p"."""
    dataset = source(shuffle=shuffled)
    dataset.shuffle_window = 0
    return dataset


@cache
def block_order_run(shuffled: bool) -> str:
    """JSON of the whole one-rank run in block order and of its StatefulDataLoader state after 3 samples:
    the same for every drawn edit, so made once per ``shuffled``."""
    full = list(source_in_block_order(shuffled))
    state = saved(lambda: StatefulDataLoader(source_in_block_order(shuffled), batch_size=None, num_workers=0), 3)
    return json.dumps({"full": full, "state": state})


@settings(max_examples=examples(150), deadline=None)
@given(
    intervals=st.lists(st.tuples(st.integers(-3, TOTAL + 3), st.integers(-3, TOTAL + 3)), max_size=5),
    shuffled=st.booleans(),
)
def test_edited_remaining_intervals_yield_exactly_those_positions_or_fail(
    intervals: list[tuple[int, int]], shuffled: bool
) -> None:
    """Position p of a one-rank run is its p-th sample, so any valid ``remaining``
    is checkable: exactly those positions, in order; any other is a StateError."""
    run = json.loads(block_order_run(shuffled))  # a fresh copy: the state is edited below
    full, state = run["full"], run["state"]
    state["dataset_state"]["remaining"] = [list(i) for i in intervals]
    valid = all(0 <= a < b <= TOTAL for a, b in intervals) and all(
        intervals[i][1] <= intervals[i + 1][0] for i in range(len(intervals) - 1)
    )
    loader = StatefulDataLoader(source_in_block_order(shuffled), batch_size=None, num_workers=0)
    if valid:
        loader.load_state_dict(state)
        assert list(loader) == [full[p] for a, b in intervals for p in range(a, b)]
    else:
        with pytest.raises(StateError):
            loader.load_state_dict(state)
            list(loader)


def deferred(path: Path_) -> bool:
    """Fields a MixedLoader checks in its workers, against the dataset: the fingerprint's contents."""
    return "fingerprint" in path[:-1]


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mixed_loader_state_missing_or_retyping_a_field_is_refused_before_workers_start(data: Any) -> None:
    state = mixed_state()
    how, path, value = data.draw(mutations(state).filter(lambda m: m[0] != "shift" and not deferred(m[1])))
    if how == "retype" and (in_sample(path) or path[-1] == "payload"):
        return  # another encoded value may still be samples: covered by the carry checks above
    if how == "retype" and value is None and (may_be_none(state, path) or path[-1] == "worker"):
        return
    loader = MixedLoader(carrying_data(), 8, num_workers=2)
    with pytest.raises(StateError):
        loader.load_state_dict(mutate(state, how, path, value))


@pytest.mark.slow
def test_fields_checked_against_the_dataset_fail_in_the_workers_as_state_errors() -> None:
    """What only a worker can check (fingerprint, the rank's chunk, the rank)
    reaches the main process as a StateError."""
    cases = [
        (lambda p: p["fingerprint"].pop("seed"), "saved with dataset"),
        (lambda p: p.update(remaining=[[0, TOTAL + 1]]), "past the end of this rank's chunk"),
        (lambda p: p.update(rank=1, world_size=2), "world_size 2, but here it is 1"),
    ]
    for change, message in cases:
        state = mixed_state()
        for planned in nodes(state["workers"], "planned"):
            change(planned)
        loader = MixedLoader(carrying_data(), 8, num_workers=2)
        loader.load_state_dict(state)
        with pytest.raises(StateError, match=message):
            list(loader)
        state = saved(lambda: StatefulDataLoader(Shuffle(source(), 10), batch_size=None, num_workers=2), 9)
        for planned in nodes(state, "planned"):
            change(planned)
        loader = StatefulDataLoader(Shuffle(source(), 10), batch_size=None, num_workers=2)
        with pytest.raises(StateError, match=message):
            loader.load_state_dict(state)
            read_all(loader)


# -- ints past int64, a finished state that still holds samples, an overfull shuffle buffer --

HUGE = [2**63, 2**64 + 5, -(2**63) - 1, 10**30]


@pytest.mark.parametrize("kind", ["planned", "shuffle"])
@pytest.mark.parametrize("value", [2**63, 10**30])
def test_an_epoch_past_int64_is_a_state_error_naming_the_epoch(kind: str, value: int) -> None:
    def make() -> Pipeline:
        return Shuffle(source(), 6).map(str.upper)

    state = saved(lambda: StatefulDataLoader(make(), batch_size=None, num_workers=0), 9)
    for node in nodes(state, "planned") + nodes(state, "shuffle"):
        node["epoch"] = value  # consistent over the stages: only the size is wrong
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    with pytest.raises(StateError, match=r"state\['epoch'\] must be an int .*<= 9223372036854775807"):
        loader.load_state_dict(state)
        list(loader)


def test_a_mixed_loader_epoch_past_int64_is_a_state_error_naming_the_epoch() -> None:
    state = mixed_state()
    for node in [state, *nodes(state, "planned"), *nodes(state, "shuffle")]:
        node["epoch"] = 2**63
    loader = MixedLoader(carrying_data(), 8, num_workers=2)
    with pytest.raises(StateError, match=r"state\['epoch'\] must be an int"):
        loader.load_state_dict(state)


def int_paths(tree: Any) -> list[Path_]:
    """Paths to the ints of a state outside samples and numpy generator states (which hold any int)."""
    return [p for p in paths(tree) if type(at(tree, p)) is int and "generator" not in p and not in_sample(p)]


def named(path: Path_) -> str:
    """What the error must name: the field (a key), or the field holding the list item."""
    key = next(key for key in reversed(path) if isinstance(key, str))
    return re.escape(key)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_int_of_a_state_set_past_int64_is_a_state_error(data: Any) -> None:
    run = json.loads(every_kind_run())
    state = data.draw(st.sampled_from(run["states"]))
    path = data.draw(st.sampled_from(int_paths(state["dataset_state"])))
    value = data.draw(st.sampled_from(HUGE))
    tampered = {**state, "dataset_state": mutate(state["dataset_state"], "shift", path, value)}
    loader = StatefulDataLoader(every_kind(), batch_size=None, num_workers=0)
    with pytest.raises(StateError, match=named(path)):
        loader.load_state_dict(tampered)
        list(loader)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_int_of_a_mixed_loader_state_set_past_int64_is_refused_when_loaded(data: Any) -> None:
    state = mixed_state()
    path = data.draw(st.sampled_from([p for p in int_paths(state) if not deferred(p)]))
    value = data.draw(st.sampled_from(HUGE))
    loader = MixedLoader(carrying_data(), 8, num_workers=2)
    with pytest.raises(StateError, match=named(path)):
        loader.load_state_dict(mutate(state, "shift", path, value))


def test_a_finished_mixed_loader_state_that_still_holds_samples_is_a_state_error() -> None:
    """Before: the loader believed ``finished`` and silently delivered nothing of what was left.

    Saved after one batch of ten times the records: the workers cannot have read them all yet (with 89
    records, a worker can reach its end before the save, and its saved state then holds nothing)."""

    def big() -> ShardedDataset:
        return ShardedDataset(synthetic_shards([10 * c for c in COUNTS]), synthetic_read, shuffle=True, seed=5)

    saving = MixedLoader(Shuffle(big(), 10).map(to_record), 8, num_workers=2, micro_batch_size=3)
    iterator = iter(saving)
    next(iterator)
    state = roundtrip(saving.state_dict())
    del iterator, saving
    state.update(finished=True, carry=[])
    loader = MixedLoader(Shuffle(big(), 10).map(to_record), 8, num_workers=2, micro_batch_size=3)
    loader.load_state_dict(state)
    with pytest.raises(StateError, match=r"state\['finished'\] is true, but worker \d still holds samples"):
        list(loader)


def test_a_finished_mixed_loader_state_with_a_carry_is_refused_when_loaded() -> None:
    state = mixed_state()
    state["finished"] = True
    loader = MixedLoader(carrying_data(), 8, num_workers=2)
    with pytest.raises(StateError, match=r"state\['finished'\] is true, but state\['carry'\] holds \d tail"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_really_finished_mixed_loader_state_resumes_to_an_empty_epoch_then_the_next(drop_last: bool) -> None:
    loader = MixedLoader(Shuffle(source(), 10).map(to_record), 8, num_workers=2, drop_last=drop_last)
    delivered = sum(len(batch["id"]) for batch in loader)
    state = roundtrip(loader.state_dict())
    assert state["finished"] and delivered == (TOTAL // 8 * 8 if drop_last else TOTAL)
    again = MixedLoader(Shuffle(source(), 10).map(to_record), 8, num_workers=2, drop_last=drop_last)
    again.load_state_dict(state)
    assert list(again) == []
    assert sum(len(batch["id"]) for batch in again) == delivered  # the next epoch, whole


def test_a_shuffle_state_holding_more_samples_than_its_buffer_is_a_state_error() -> None:
    """Before: 10,000 buffered samples loaded into .shuffle(4) and were all delivered."""

    def make(size: int) -> Pipeline:
        return Shuffle(by_data(), size).map(str.upper)

    state = saved(lambda: StatefulDataLoader(make(4), batch_size=None, num_workers=0), 9)
    nodes(state, "shuffle")[0]["samples"] = ["planted"] * 10_000
    loader = StatefulDataLoader(make(4), batch_size=None, num_workers=0)
    loader.load_state_dict(state)
    with pytest.raises(StateError, match=r"state\['samples'\] holds 10000 samples, more than .*shuffle\(4"):
        list(loader)
    state = saved(lambda: StatefulDataLoader(make(6), batch_size=None, num_workers=0), 9)
    loader = StatefulDataLoader(make(4), batch_size=None, num_workers=0)
    loader.load_state_dict(state)  # a larger buffer's state into a smaller one
    with pytest.raises(StateError, match=r"holds 5 samples, more than .*shuffle\(4"):
        list(loader)


def test_merged_worker_buffers_may_hold_more_than_one_buffer_and_resume_exactly_once() -> None:
    """Two workers' full buffers merged load into one worker (each buffer at most its size)."""

    def make() -> Pipeline:
        return Shuffle(by_data(), 6)

    loader = StatefulDataLoader(make(), batch_size=None, num_workers=2)
    iterator = iter(loader)
    delivered = [next(iterator) for _ in range(20)]
    workers = roundtrip(loader.state_dict())["_snapshot"]["_worker_snapshots"]
    merged = merge([w["dataset_state"] for w in workers.values()])
    assert len(merged["samples"]) == 10 and merged["pooled"] == 2  # each buffer gave one sample after a refill
    rest = list(StatefulDataLoader(_loaded(make(), roundtrip(merged)), batch_size=None, num_workers=0))
    assert Counter(delivered + rest) == Counter(source())
    merged["samples"] += ["planted"] * 3
    with pytest.raises(StateError, match=r"holds 13 samples, more than 2 buffers of .*shuffle\(6"):
        make().load_state_dict(merged)
    with pytest.raises(StateError, match=r"state\['pooled'\] must be >= 1"):
        make().load_state_dict({**next(iter(workers.values()))["dataset_state"], "pooled": 0})
    with pytest.raises(StateError, match=r"state\['repeats'\] must be indices below 10"):
        make().load_state_dict({**merged, "samples": merged["samples"][:10], "repeats": [3, 10]})
    with pytest.raises(StateError, match=r"state\['balance'\] must be one of"):
        make().load_state_dict({**merged, "samples": merged["samples"][:10], "balance": "even"})
    with pytest.raises(StateError, match="a global shuffle state"):
        make().load_state_dict({**merged, "samples": merged["samples"][:10], "balance": "pad", "share": [0, 2]})


def _loaded(pipeline: Pipeline, state: Any) -> Pipeline:
    pipeline.load_state_dict(state)
    return pipeline


# -- every int of every kind of node, past int64 and negative, refused at load --


def _tokens(sample: Any) -> dict[str, Any]:
    return {"input_ids": np.arange(5 + len(str(sample)) % 7, dtype=np.int32)}  # 5-11: blocks of 16 cut some


def _keep(sample: Any) -> bool:
    return True


def packed_mix(rank: int | None = None, world_size: int | None = None, stream: bool = True) -> Pipeline:
    """A pipeline with a node of every registered kind (a scheduled interleave, a pack) but ``stream``
    (when False: a global state, merged over ranks, cannot hold one)."""
    planned = Shuffle(source(rank=rank, world_size=world_size), 5).map(_tokens)
    other = wrap(CountingStream(30)) if stream else source(seed=9, rank=rank, world_size=world_size)
    schedule = Schedule([(0, [2, 1]), (20, [1, 1])])
    mixed = interleave([planned, other.filter(_keep).map(_tokens)], weights=schedule, seed=3, stop="all_exhausted")
    return mixed.repeat(2).pack(16).batch(2, list)


@cache
def packed_mix_states() -> str:
    """JSON of: a state of ``packed_mix()`` mid-epoch, and a global one merged from two ranks."""
    iterator = iter(packed_mix())
    for _ in range(3):
        next(iterator)
    ranks = []
    for rank in range(2):
        per_rank = iter(packed_mix(rank, 2, stream=False))
        for _ in range(3):
            next(per_rank)
        ranks.append(per_rank.state_dict())
    return json.dumps({"local": iterator.state_dict(), "global": merge_ranks(ranks)})


#: Ints that may be negative: none outside samples and generator states.
NEGATIVE_ALLOWED: frozenset[str] = frozenset()


def every_int_case() -> list[tuple[str, Path_, int]]:
    states = json.loads(packed_mix_states())
    return [
        (which, path, value)
        for which, state in states.items()
        for path in int_paths(state)
        for value in (2**63, -1)
        if value >= 0 or path[-1] not in NEGATIVE_ALLOWED
    ]


def test_the_int_walk_covers_a_node_of_every_registered_kind() -> None:
    states = json.loads(packed_mix_states())
    kinds = {at(state, p) for state in states.values() for p in paths(state) if p[-1] == "kind"}
    assert kinds == set(_STAGES)
    fields = {next(k for k in reversed(path) if isinstance(k, str)) for _, path, _ in every_int_case()}
    assert {"pieces", "realised", "reader", "ranks", "remaining", "next", "seed"} <= fields


@pytest.mark.parametrize("which, path, value", every_int_case(), ids=lambda v: str(v).replace(" ", ""))
def test_any_int_of_any_node_past_int64_or_negative_is_a_state_error_naming_it_at_load(
    which: str, path: Path_, value: int
) -> None:
    """Before: a pack piece's position of 2**63 loaded, then failed in numpy (or gave negative position_ids);
    a schedule's realised count and a stream's reader count of 2**63 loaded too."""
    state = mutate(json.loads(packed_mix_states())[which], "shift", path, value)
    pipeline = packed_mix() if which == "local" else packed_mix(0, 2, stream=False)
    with pytest.raises(StateError, match=named(path)):
        pipeline.load_state_dict(state)  # at load, not when iterated


def test_a_pack_piece_whose_positions_would_pass_int64_is_a_state_error_at_load() -> None:
    state = json.loads(packed_mix_states())["local"]
    pack = nodes(state, "pack")[0]
    assert pack["pieces"], "the save point must hold a piece"
    pack["pieces"][0][1] = 2**63 - 2  # fits, but its tokens' positions 2**63 - 2 + k do not
    with pytest.raises(StateError, match=r"state\['pieces'\]\[0\] starts at position 9223372036854775806"):
        packed_mix().load_state_dict(state)


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, 2**70])
def test_a_state_of_a_dataset_seeded_past_int64_resumes_exactly(seed: int) -> None:
    """A seed is any int >= 0; the dataset fingerprint a state holds is only compared, so it may hold one."""
    full = list(Shuffle(source(seed=seed), 5))
    loader = StatefulDataLoader(Shuffle(source(seed=seed), 5), batch_size=None, num_workers=0)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(9)]
    resumed = StatefulDataLoader(Shuffle(source(seed=seed), 5), batch_size=None, num_workers=0)
    resumed.load_state_dict(roundtrip(loader.state_dict()))
    assert first + list(resumed) == full
