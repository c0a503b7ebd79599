"""Each stage's resume contract lives in one place: its iterator class.

These tests pin down the structure (the kind registry is built from the stage
classes, every kind's keys are documented, a stage iterator is not a torchdata
``Stateful`` of its own) and the one check ``Pipeline.__iter__`` makes for
every stage: whether a loaded state applies to the iteration it opens.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from torchdata.stateful_dataloader import Stateful

import shardkit
import shardkit.state
import shardkit.stateful.protocol
from shardkit import ShardedDataset, interleave, wrap
from shardkit.pipeline import Pipeline, Shuffle
from shardkit.state import StageIterator, StateError, merge, stage_of
from tests.helpers.load import hang_bound
from tests.helpers.reading import CountingStream
from tests.helpers.shards import synthetic_read, synthetic_shards

ROOT = Path(__file__).resolve().parents[2]


def source(**kwargs: Any) -> ShardedDataset:
    return ShardedDataset(synthetic_shards([7, 5, 9]), synthetic_read, **kwargs)


def every_stage() -> Pipeline:
    """A pipeline with one stage of every kind of state."""
    planned = Shuffle(source(shuffle=True, seed=3), 4).map(str.upper).filter(bool)
    mixed = interleave([planned, wrap(CountingStream(12)).map(str)], seed=1, stop="all_exhausted")
    return mixed.batch(2, collate_fn=list).repeat(2)


def nodes(state: Any) -> list[dict[str, Any]]:
    """Every node of a state tree."""
    if not isinstance(state, dict):
        return []
    upstream = state.get("upstream")
    parts = upstream if isinstance(upstream, list) else [upstream]
    return [state] + [node for part in parts for node in nodes(part)]


def saved_state(make=every_stage, steps: int = 5) -> dict[str, Any]:
    pipeline = make()
    iterator = iter(pipeline)
    for _ in range(steps):
        next(iterator)
    return json.loads(json.dumps(pipeline.state_dict()))


def test_every_kind_a_pipeline_saves_is_owned_by_a_registered_stage_iterator() -> None:
    kinds = {node["kind"] for node in nodes(saved_state())}
    assert kinds == {"repeat", "batch", "interleave", "filter", "map", "shuffle", "planned", "stream"}
    for kind in kinds:
        stage = stage_of(kind)
        assert stage is not None and issubclass(stage, StageIterator) and stage.KIND == kind


def test_every_key_of_every_saved_node_is_a_constant_of_its_stage_or_a_shared_one() -> None:
    shared = {"version", "kind", shardkit.state.EPOCH, shardkit.state.SHARE, shardkit.state.RNG}
    shared.add(shardkit.state.UPSTREAM)
    for node in nodes(saved_state()):
        stage = stage_of(node["kind"])
        constants = {value for name, value in vars(stage).items() if name.isupper() and isinstance(value, str)}
        assert set(node) - shared - constants == set(), node["kind"]


def test_every_kind_and_its_keys_are_described_by_the_class_that_owns_the_kind() -> None:
    for node in nodes(saved_state()):
        stage = stage_of(node["kind"])
        doc = stage.__doc__ or ""
        source = inspect.getsource(stage)  # a key constant's own doc comment describes it too
        assert f'``"{node["kind"]}"``' in doc, stage.__qualname__
        for key in set(node) - {"version", "kind"}:
            described = f"``{key}``" in doc or re.search(rf'= "{key}"  #: state key: \S', source)
            assert described, f"{node['kind']}: key {key!r} is not described by {stage.__qualname__}"


def test_a_second_stage_claiming_a_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="state kind 'shuffle' is already _ShuffleIterator's"):

        class Impostor(StageIterator):
            KIND = "shuffle"


def test_stage_iterators_are_not_torchdata_stateful_so_a_state_is_loaded_once() -> None:
    # StatefulDataLoader loads an iterator that has state_dict and load_state_dict a
    # second time, after the pipeline's own load_state_dict has resumed it.
    pipeline = every_stage()
    iterator = iter(pipeline)
    assert isinstance(pipeline, Stateful)
    assert not isinstance(iterator, Stateful)


@pytest.mark.slow  # a new interpreter importing torch: seconds of CPU
def test_merge_in_a_fresh_process_that_imports_only_shardkit_state_knows_every_stage(tmp_path: Path) -> None:
    """A tool that merges saved worker states from files imports no pipeline module itself."""
    workers = []
    for worker in range(2):
        dataset = ShardedDataset(synthetic_shards([7, 5, 9]), synthetic_read, rank=0, world_size=1)
        workers.append(
            {
                "version": 1,
                "kind": "shuffle",
                "epoch": 0,
                "samples": [f"s{worker}"],
                "rng": None,
                "share": [worker, 2],
                "upstream": {**saved_state(lambda d=dataset: d, 0), "share": [worker, 2], "remaining": []},
            }
        )
    path = tmp_path / "workers.json"
    path.write_text(json.dumps(workers))
    script = textwrap.dedent(
        f"""
        import json, sys
        from shardkit.state import merge  # the script names no stage module
        merged = merge(json.load(open({str(path)!r})))
        print(json.dumps([merged["kind"], merged["samples"], merged["upstream"]["kind"]]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=hang_bound(120)
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["shuffle", ["s0", "s1"], "planned"]


def test_a_state_of_an_earlier_epoch_is_dropped_with_every_input_state_below_it() -> None:
    # Saved in pass 1 of a repeat over epoch 0: the source's node is of epoch 1. After
    # set_epoch(1) the repeat's node is stale, and so is the source's, though its epoch
    # number is the one pass 0 now reads: resuming it would cut epoch 1 short.
    def make() -> Pipeline:
        return Shuffle(source(shuffle=True, seed=5), 6).map(str.upper).repeat(2)

    state = saved_state(make, 21 + 4)  # 21 records a pass: 4 into pass 1
    assert state["epoch"] == 0 and state["upstream"]["upstream"]["epoch"] == 1
    fresh = make()
    fresh.set_epoch(1)
    expected = list(fresh)
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == expected and len(expected) == 42


def test_a_state_of_a_later_epoch_names_the_set_epoch_call() -> None:
    state = saved_state(lambda: Shuffle(source(shuffle=True, seed=5), 6), 4)
    state["epoch"] = state["upstream"]["epoch"] = 3
    resumed = Shuffle(source(shuffle=True, seed=5), 6)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    with pytest.raises(StateError, match=r"epoch 3, but this iteration reads epoch 1; call set_epoch\(3\)"):
        iter(resumed)


def test_a_shuffle_state_of_another_worker_is_refused_naming_the_fix() -> None:
    from tests.helpers.reading import run_as_worker

    def save() -> dict[str, Any]:
        return saved_state(lambda: Shuffle(source(shuffle=True, seed=5), 6), 3)

    state = run_as_worker(0, 2, save)
    resumed = Shuffle(source(shuffle=True, seed=5), 6)
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match="worker 0's of 2, loaded into worker 1 of 2.*merge the states"):
        run_as_worker(1, 2, lambda: iter(resumed))
    rest = run_as_worker(0, 2, lambda: list(_loaded(state)))
    assert rest  # its own worker resumes it


def _loaded(state: dict[str, Any]) -> Pipeline:
    pipeline = Shuffle(source(shuffle=True, seed=5), 6)
    pipeline.load_state_dict(state)
    return pipeline


def test_merge_hands_each_node_to_its_stage_and_refuses_an_unknown_kind() -> None:
    state = saved_state()
    assert merge([state]) == merge([json.loads(json.dumps(state))])
    with pytest.raises(StateError, match="unknown state kind 'mystery'; known: .*planned"):
        merge([{**state, "kind": "mystery"}])


@pytest.mark.slow  # a new interpreter importing torch: seconds of CPU
def test_shardkit_interleave_is_the_function_whichever_module_was_imported_first() -> None:
    script = textwrap.dedent(
        """
        import shardkit.pipeline.interleaving  # the submodule first: it must not shadow the function
        import shardkit
        from shardkit.pipeline import interleave as from_pipeline
        from shardkit.pipeline.mixing import interleave as from_module
        assert from_pipeline is from_module is shardkit.interleave
        mixed = shardkit.interleave([shardkit.wrap([1, 2]), shardkit.wrap([3])], stop="all_exhausted")
        print(sorted(mixed))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=hang_bound(120)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1, 2, 3]"
    assert shardkit.interleave([wrap([1])], seed=0).__class__.__name__ == "Interleave"


def test_the_interleave_docstring_example_runs_as_shown() -> None:
    import doctest

    import shardkit.pipeline.mixing as module

    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_a_node_of_another_registered_kind_in_a_stage_is_refused_naming_both() -> None:
    state = saved_state(lambda: Shuffle(source(shuffle=True, seed=5), 6).map(str.upper), 4)
    state["upstream"] = {**state["upstream"], "kind": "interleave"}  # a shuffle's node relabelled
    resumed = Shuffle(source(shuffle=True, seed=5), 6).map(str.upper)
    with pytest.raises(StateError, match="of a 'interleave' stage but this stage is 'shuffle'"):
        resumed.load_state_dict(state)
    with pytest.raises(StateError, match=r"worker 0\['upstream'\]: state\['upstream'\] must be list or tuple"):
        merge([state])


def test_the_reference_page_names_the_class_and_module_of_every_registered_kind() -> None:
    stage_of("planned")  # imports every stage module
    page = (ROOT / "docs" / "reference" / "state.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    for kind, stage in shardkit.stateful.protocol._STAGES.items():
        module = stage.__module__.replace(".", "/") + ".py"
        assert any(f"`{kind}`" in row and f"`{stage.__name__}`" in row and module in row for row in rows), kind
