"""Saved positions, below every stage: the node protocol (:mod:`.protocol`), the
positions of held records (:mod:`.positions`) and the sample codec (:mod:`.codec`). The state format itself is described in
:mod:`shardkit.state`, the public module that also merges states over ranks."""

from shardkit.errors import StateError
from shardkit.seeding import generator_state
from shardkit.stateful.codec import decode, encode, restore_generator, same_data, short
from shardkit.stateful.positions import *  # noqa: F403  (positions of held records, re-exported whole)
from shardkit.stateful.positions import __all__ as _position_names
from shardkit.stateful.protocol import *  # noqa: F403  (the protocol, re-exported whole)
from shardkit.stateful.protocol import __all__ as _node_names

__all__ = [
    "StateError", "decode", "encode", "generator_state", "restore_generator", "same_data", "short", *_node_names, *_position_names,
]  # fmt: skip
