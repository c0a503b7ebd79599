"""Chainable wrappers: every shardkit dataset is a :class:`Pipeline`.

``source.shuffle(1000).map(decode).batch(32)`` builds a chain of pipelines;
:func:`interleave` mixes several. The package is layered like every stage:
the classes that configure the stages (:mod:`.mixing` over :mod:`.stages`)
sit above the iterators that run them and own their saved state
(:mod:`.mapping`, :mod:`.shuffling`, :mod:`.batching`, :mod:`.repeating`,
:mod:`.interleaving`, :mod:`.packing`), which never import back.
"""

from shardkit.pipeline.blocks import PackError
from shardkit.pipeline.interleaving import STOP_RULES  # noqa: F401  (importable here, as the stop= values)
from shardkit.pipeline.mixing import Interleave, interleave
from shardkit.pipeline.scheduling import mixture_shares
from shardkit.pipeline.stages import (
    Batch,
    Filter,
    Map,
    Pack,
    Pipeline,
    PipelineError,
    Repeat,
    Shuffle,
    UnknownLengthError,
)

__all__ = [
    "Batch",
    "Filter",
    "Interleave",
    "Map",
    "Pack",
    "PackError",
    "Pipeline",
    "PipelineError",
    "Repeat",
    "Shuffle",
    "UnknownLengthError",
    "interleave",
    "mixture_shares",
]
