"""The saved state of :func:`~shardkit.even_batches`, as plain data: made, checked field by field, merged over ranks.

:class:`~shardkit.even.wrapper.EvenBatches` and its epoch iterator decide
what goes in a state (see the wrapper's module docstring, "Resuming"); this
module holds the fields' defaults, refuses a loaded state whose fields are
missing, mistyped or do not hold together (naming them), and merges the
states of several ranks for another world size, which is possible only where
no rank held batches fetched ahead: they were fetched by one rank's loader and
cannot be dealt out again.
"""

from __future__ import annotations

import inspect
from typing import Any

from shardkit.even.auto import AUTO_MAX, MEASURED, first_window
from shardkit.ranks import ranks_node
from shardkit.stateful import State, StateError, check, decode, field, node, short, whole_number

__all__ = ["checked", "inner_state", "load_inner", "merged", "state_of"]


def state_of(owner: Any, **fields: Any) -> State:
    """The state of ``owner`` (an :class:`~shardkit.even.wrapper.EvenBatches`): ``fields`` over an epoch's start."""
    defaults: dict[str, Any] = {
        "window": [],
        "next": [],
        "quota": 0,
        "target": first_window(owner.every),
        "last": False,
        "pad": [],
        "exhausted": False,
        "finished": False,
        "batches": 0,
        "padded": 0,
        "from_inner": 0,
        "dropped_ahead": 0,
        "agreements": 0,
        "auto": 0,
        "steps": [],
    }
    fields.setdefault("epoch", owner.epoch)
    return node("even_batches", at_end=owner.at_end, every=owner.every, **{**defaults, **fields})


def checked(state: object, owner: Any) -> State:
    """A loaded state with every field checked and its batches decoded
    (``pad`` as a one-tuple), so a bad state fails in ``load_state_dict``."""
    where = f"{owner!r}.load_state_dict()"
    state = check(state, "even_batches", owner)
    whole_number(state, "epoch", where)
    at_end, every = field(state, "at_end", where, str), field(state, "every", where, int, str)
    if at_end != owner.at_end or every != owner.every:
        raise StateError(
            f"{where}: the state was saved by even_batches(at_end={at_end!r}, every={every!r}); "
            "resume with the same settings"
        )
    largest = AUTO_MAX if every == "auto" else whole_number(state, "every", where, 1)
    state, auto_problems = _checked_auto(state, where, every)
    if "inner" not in state:
        raise StateError(f"{where}: the state has no 'inner' (the wrapped loader's state)")
    counts = {key: whole_number(state, key, where) for key in ("quota", "batches", "padded", "from_inner")}
    whole_number(state, "dropped_ahead", where)
    target = whole_number(state, "target", where, 1)
    flags = {key: field(state, key, where, bool) for key in ("last", "exhausted", "finished")}
    window = [decode(b) for b in field(state, "window", where, list, tuple)]
    ahead = [decode(b) for b in field(state, "next", where, list, tuple)]
    pad = [decode(b) for b in field(state, "pad", where, list, tuple)]  # the batch to repeat, if any
    problems = [
        f"{len(window)} batches held for a window of {counts['quota']}" * (len(window) > counts["quota"]),
        f"{len(ahead)} batches fetched for a window of {target}" * (len(ahead) > target or target > largest),
        *auto_problems,
        "more batches padded or read than yielded" * (counts["padded"] + counts["from_inner"] != counts["batches"]),
        f"{len(pad)} batches to repeat" * (len(pad) > 1 or (bool(pad) and at_end == "stop")),
        "a finished epoch holding batches" * (flags["finished"] and bool(window or ahead)),
    ]
    if any(problems):
        raise StateError(f"{where}: the state does not hold together: {'; '.join(p for p in problems if p)}")
    return {**state, "window": window, "next": ahead, "pad": tuple(pad) or None}


def _checked_auto(state: State, where: str, every: object) -> tuple[State, list[str]]:
    """The state with the fields of ``every="auto"`` checked, and what does not hold together in them."""
    # States saved before every="auto" have none of them: none of their agreements chose a window.
    state = {"agreements": 0, "auto": 0, "steps": [], **state}
    whole_number(state, "agreements", where)
    chosen = whole_number(state, "auto", where)
    steps = field(state, "steps", where, list, tuple)
    return state, [
        f"a window of {chosen} chosen by every={every!r}" * (chosen > (AUTO_MAX if every == "auto" else 0)),
        f"step times {short(steps)}" * any(type(t) is not float or not 0 <= t < float("inf") for t in steps),
        f"{len(steps)} step times (at most {MEASURED} are measured)" * (len(steps) > MEASURED),
    ]


def inner_state(loader: Any) -> Any:
    """The wrapped loader's state: this rank's own, as the wrapper gathers every rank's itself."""
    save = getattr(loader, "state_dict", None)
    if not callable(save):
        raise StateError(
            f"even_batches cannot save its position: {type(loader).__name__} has no state_dict(); "
            "wrap a shardkit.MixedLoader or torchdata's StatefulDataLoader to resume"
        )
    if "gather" in inspect.signature(save).parameters:  # shardkit's loaders: this rank's own, gathered above
        return save(gather=False)
    return save()


def load_inner(loader: Any, state: Any) -> None:
    """Give the wrapped loader its part of a loaded state."""
    load = getattr(loader, "load_state_dict", None)
    if not callable(load):
        raise StateError(f"even_batches cannot resume: {type(loader).__name__} has no load_state_dict()")
    load(state)


def merged(entries: list[State], owner: Any) -> State:
    """The state of every rank as one, for another world size: only where no rank held batches."""
    where = f"{owner!r}.load_state_dict()"
    states = [checked(entry, owner) for entry in entries]
    held = [rank for rank, e in enumerate(states) if e["window"] or e["next"]]
    if held:
        raise StateError(
            f"{where}: the state was saved on {len(entries)} ranks and rank(s) {held} held batches fetched ahead, "
            "which cannot be dealt out to another number of ranks; resume on the same world size, or save at "
            "an epoch's start or end"
        )
    if len({e["epoch"] for e in states}) != 1:
        raise StateError(f"{where}: the ranks saved different epochs {sorted({e['epoch'] for e in states})}")
    inner = ranks_node([e["inner"] for e in entries])  # the wrapped loader merges its own
    return state_of(owner, epoch=states[0]["epoch"], inner=inner, finished=all(e["finished"] for e in states))
