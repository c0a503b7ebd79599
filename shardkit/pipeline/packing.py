"""The iterator of ``.pack()``: documents (token arrays) packed into blocks of ``seq_len`` tokens.

Each block is ``{"input_ids", "position_ids", "document_ids"}``, three
``LongTensor[seq_len]``: the tokens, each token's position in its document
(0 at a document's start; a document split over blocks goes on counting
where it left off), and the index of its document within the block (0, 1,
...), ``-1`` where the block is padded with ``pad_id``. Padding positions
count 0, 1, ... like a document of their own, so both a block-diagonal mask
(from ``document_ids``) and ``cu_seqlens`` (from ``position_ids``) keep them
apart from the documents (see ``docs/pretraining.md``).

Two strategies:

* ``"concat"`` lays the documents end to end and cuts the stream every
  ``seq_len`` tokens: a document may start in one block and end in the
  next; only a reader's last block is padded.
* ``"best_fit"`` keeps every document whole (one longer than ``seq_len`` is
  cut into ``seq_len`` pieces and a shorter rest). It holds up to
  ``buffer_size`` documents; when the buffer is full, a block opens with
  the oldest piece (one with ``k`` older pieces is in one of the next
  ``k + 1`` blocks) and is filled with, again and again, the longest piece
  that still fits. With a buffer of hundreds of documents, blocks are above
  99% full.

The work per document is a few list operations (``bisect`` over the
buffer's lengths); tokens are only sliced and copied by numpy, never touched
one by one in Python. What is not yet in a block is the stage's state: a
list of *pieces*, each a token array (saved encoded, in its own dtype) and
the position of its first token in its document.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardkit.errors import ShardkitError
from shardkit.stateful import (
    EPOCH,
    INT64_MAX,
    SEQUENCE,
    SHARE,
    UPSTREAM,
    Resume,
    StageIterator,
    State,
    StateError,
    check_all_shares,
    check_inputs_epoch,
    check_share,
    combine_ranks,
    decode,
    encode,
    expect_equal,
    field,
    merge,
    node,
    same_data,
    same_value,
    share_field,
    short,
    upstream_state,
    whole_number,
)
from shardkit.topology import Topology

#: The packing strategies ``.pack(strategy=...)`` takes.
STRATEGIES = ("concat", "best_fit")

#: ``document_ids`` of the positions a block is padded with.
PAD_DOCUMENT = -1

Piece = tuple[np.ndarray, int]  # tokens (1-D integers, any int dtype) and the position of the first in its document


class PackError(ShardkitError, ValueError):
    """A sample ``.pack()`` cannot take: no token array at its key, or not a 1-D array of integers."""


def tokens_of(sample: Any, key: str) -> np.ndarray:
    """The 1-D integer token array at ``key`` of ``sample`` (a numpy array, a list of ints or a tensor),
    without copying when it already is a numpy array.

    Raises:
        PackError: the sample is not a mapping with ``key``, or its value is not 1-D integers.
    """
    if not isinstance(sample, Mapping) or key not in sample:
        keys = sorted(map(str, sample)) if isinstance(sample, Mapping) else None
        what = f"a sample with keys {keys}" if keys is not None else f"a {type(sample).__name__} sample"
        raise PackError(
            f"pack(key={key!r}) got {what}, which has no {key!r}; pass key= the name of the token array, "
            "or .map() the samples to dicts holding one"
        )
    value = sample[key]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)  # a view of a numpy array (or memmap), never a copy of one
    if array.ndim == 1 and array.size == 0:
        return np.zeros(0, np.int64)  # an empty document (of any dtype, [] too) packs to nothing
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise PackError(
            f"pack(key={key!r}): the sample's {key!r} must be a 1-D array of integer token ids "
            f"(numpy array, list of ints or tensor), got {type(value).__name__} of shape {array.shape} "
            f"and dtype {array.dtype}"
        )
    return array


def block(parts: Sequence[Piece], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One packed block from ``parts`` (at most ``seq_len`` tokens in all), padded at the end.

    The three rows are made in one ``[3, seq_len]`` array with a handful of numpy calls
    (the cost of a block is their overhead, not its tokens).
    """
    lengths = [len(tokens) for tokens, _ in parts]
    used = sum(lengths)
    rows = np.empty((3, seq_len), np.int64)
    input_ids, position_ids, document_ids = rows
    if parts:
        np.concatenate([tokens for tokens, _ in parts], out=input_ids[:used], casting="unsafe")
    input_ids[used:] = pad_id
    # A token's position is its index in the block less where its piece starts, plus the piece's first position.
    shifts, start = [], 0
    for length, (_, first) in zip(lengths, parts):
        shifts.append(start - first)
        start += length
    position_ids[:] = np.arange(seq_len)
    position_ids[:used] -= np.repeat(shifts, lengths)
    position_ids[used:] -= used  # the padding counts from 0, like a document of its own
    document_ids[:used] = np.repeat(np.arange(len(parts)), lengths)
    document_ids[used:] = PAD_DOCUMENT
    tensors = torch.from_numpy(rows)
    return {"input_ids": tensors[0], "position_ids": tensors[1], "document_ids": tensors[2]}


class _PackIterator(StageIterator):
    """Blocks of ``seq_len`` tokens from the documents at ``key`` of the input's samples.

    State node (kind ``"pack"``): ``epoch``; ``strategy`` and ``seq_len``
    (a state loads only into the same packing); ``pieces``, what has been
    read and not yet packed, oldest first: each ``[tokens, first]``, the
    token array (encoded with :func:`~shardkit.state.encode`, in the dtype
    it was read in) and the position of its first token in its document
    (non-zero for the rest of a document cut at a block's end); ``ranks``:
    None for one rank's node, else the number of ranks whose pieces a global
    node (:func:`~shardkit.state.merge_ranks`) pools; ``share``; ``upstream``.
    A merged node (``share`` None) pools the pieces of every worker; each
    rank of the world loading a global node takes every ``world_size``-th
    piece from its rank on, and each worker every ``num_workers``-th of its
    rank's. Pieces are dealt whole, so every token is packed exactly
    once; the blocks after such a restore are not the uninterrupted ones.
    """

    KIND = "pack"
    STRATEGY = "strategy"  #: state key: "concat" or "best_fit"
    SEQ_LEN = "seq_len"  #: state key: tokens per block
    PIECES = "pieces"  #: state key: the tokens read and not yet packed, as [encoded tokens, first position] pairs
    RANKS = "ranks"  #: state key: None, or the number of ranks a global node's pieces come from

    def __init__(
        self,
        source: Iterator[Any],
        *,
        seq_len: int,
        key: str,
        strategy: str,
        pad_id: int,
        buffer_size: int,
        epoch: int,
        topology: Topology,
    ) -> None:
        self._source = source
        self._seq_len = seq_len
        self._key = key
        self._strategy = strategy
        self._pad_id = pad_id
        self._buffer_size = buffer_size
        self._epoch = epoch
        self._topology = topology
        self._exhausted = False
        # concat: the pieces waiting, in stream order.
        self._queue: deque[Piece] = deque()
        # best_fit: the pieces waiting by arrival number (a dict keeps arrival order: oldest first),
        # and (length, arrival) pairs sorted, to find the longest that fits with bisect.
        self._buffer: dict[int, Piece] = {}
        self._by_length: list[tuple[int, int]] = []
        self._arrivals = 0

    # -- reading ---------------------------------------------------------------

    def _read(self) -> np.ndarray | None:
        """The next non-empty document of the input, or None once it has ended."""
        while not self._exhausted:
            try:
                sample = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            tokens = tokens_of(sample, self._key)
            if len(tokens):
                return tokens
        return None

    def __next__(self) -> dict[str, torch.Tensor]:
        parts = self._next_concat() if self._strategy == "concat" else self._next_best_fit()
        if not parts:
            raise StopIteration
        return block(parts, self._seq_len, self._pad_id)

    def _next_concat(self) -> list[Piece]:
        """The next ``seq_len`` tokens of the stream, cutting the document that crosses the end."""
        parts: list[Piece] = []
        room = self._seq_len
        while room:
            if self._queue:
                tokens, first = self._queue.popleft()
            else:
                read = self._read()
                if read is None:
                    break
                tokens, first = read, 0
            if len(tokens) > room:
                self._queue.appendleft((tokens[room:], first + room))
                tokens = tokens[:room]
            parts.append((tokens, first))
            room -= len(tokens)
        return parts

    def _next_best_fit(self) -> list[Piece]:
        """Fill the buffer, then open a block with its oldest piece and add the longest that fit."""
        while len(self._buffer) < self._buffer_size and (read := self._read()) is not None:
            self._add_document(read)
        if not self._buffer:
            return []
        oldest = next(iter(self._buffer))
        parts = [self._take(oldest)]
        room = self._seq_len - len(parts[0][0])
        by_length = self._by_length
        while room and by_length:
            index = bisect.bisect_right(by_length, (room, self._arrivals)) - 1
            if index < 0:
                break
            parts.append(self._take(by_length[index][1]))
            room -= len(parts[-1][0])
        return parts

    def _add_document(self, tokens: np.ndarray) -> None:
        """Buffer a document, cut into ``seq_len`` pieces if longer."""
        for first in range(0, len(tokens), self._seq_len):
            self._add((tokens[first : first + self._seq_len], first))

    def _add(self, piece: Piece) -> None:
        arrival = self._arrivals
        self._arrivals += 1
        self._buffer[arrival] = piece
        bisect.insort(self._by_length, (len(piece[0]), arrival))

    def _take(self, arrival: int) -> Piece:
        piece = self._buffer.pop(arrival)
        index = bisect.bisect_left(self._by_length, (len(piece[0]), arrival))
        del self._by_length[index]
        return piece

    def _pieces(self) -> list[Piece]:
        return list(self._queue) if self._strategy == "concat" else list(self._buffer.values())

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> State:
        """The pieces read and not yet packed (encoded), oldest first, and the input's node."""
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.STRATEGY: self._strategy,
                self.SEQ_LEN: self._seq_len,
                self.PIECES: [[encode(tokens), first] for tokens, first in self._pieces()],
                self.RANKS: None,
                SHARE: share_field(self._topology),
                UPSTREAM: upstream_state(self._source),
            },
        )

    def restore(self, resume: Resume) -> None:
        """Take up the saved pieces: all of a worker's own node; this rank's and worker's
        part of a merged one (see the class docstring)."""
        pieces = decode_pieces(resume.state, repr(resume.owner))
        if resume.state[self.RANKS] is not None:
            pieces = pieces[resume.topology.rank :: resume.topology.world_size]
        for piece in resume.part(pieces):
            if self._strategy == "concat":
                self._queue.append(piece)
            else:
                self._add(piece)

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        strategy = field(state, cls.STRATEGY, where, str)
        if strategy not in STRATEGIES:
            raise StateError(f"{where}: state['strategy'] must be one of {list(STRATEGIES)}, got {short(strategy)}")
        whole_number(state, cls.SEQ_LEN, where, 1)
        for index, piece in enumerate(field(state, cls.PIECES, where, *SEQUENCE)):
            if type(piece) not in SEQUENCE or len(piece) != 2 or type(piece[1]) is not int or piece[1] < 0:
                raise StateError(
                    f"{where}: state['pieces'][{index}] must be [encoded tokens, first position >= 0], "
                    f"got {short(piece)}"
                )
        ranks = field(state, cls.RANKS, where, int, type(None))
        if ranks is not None and ranks < 1:
            raise StateError(f"{where}: state['ranks'] must be None or >= 1, got {ranks}")
        check_share(state, where)
        if ranks is not None and state[SHARE] is not None:
            raise StateError(f"{where}: a global pack state (ranks set) must have share None")
        check_inputs_epoch(state, [field(state, UPSTREAM, where, dict)], where)

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        """Also checks the state is of this packing (strategy, ``seq_len``) and that every
        piece decodes to a token array that fits it. (The number of pieces is not bounded:
        a document longer than ``seq_len`` enters the buffer as all its pieces at once.)"""
        expect_equal(stage, "strategy", state[cls.STRATEGY], stage.strategy)
        expect_equal(stage, "seq_len", state[cls.SEQ_LEN], stage.seq_len)
        pieces = decode_pieces(state, repr(stage))
        if stage.strategy == "best_fit":
            for index, (tokens, _) in enumerate(pieces):
                if len(tokens) > stage.seq_len:
                    raise StateError(
                        f"{stage!r}: state['pieces'][{index}] holds {len(tokens)} tokens, more than seq_len "
                        f"{stage.seq_len}; best_fit buffers only pieces that fit a block"
                    )
        return super().inputs_to_load(stage, state)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """The workers' pieces pooled (worker by worker), to be dealt out anew.

        A global node not yet iterated (loaded, then saved again) stays what it is: pooling
        copies of it would deal its pieces to every rank instead of once.
        """
        check_all_shares(states)
        if any(s[cls.RANKS] is not None for s in states):
            if all(same_data(s, states[0]) for s in states):
                return states[0]
            raise StateError(
                "cannot merge a global pack state (from merge_ranks) with other workers' states; "
                "save again after every worker has iterated, or load the global state itself"
            )
        return cls._pooled(states, merge([s[UPSTREAM] for s in states]))

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        """The ranks' pieces pooled into a global node that every rank of any world takes its part of."""
        if any(s[cls.RANKS] is not None for s in states):
            raise StateError("cannot merge a global pack state with other ranks' states; it is already global")
        upstream = combine_ranks([s[UPSTREAM] for s in states])
        merged = cls._pooled(states, upstream)
        merged[cls.RANKS] = len(states)
        return merged

    @classmethod
    def _pooled(cls, states: Sequence[State], upstream: State) -> State:
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.STRATEGY: same_value(states, cls.STRATEGY),
                cls.SEQ_LEN: same_value(states, cls.SEQ_LEN),
                cls.PIECES: [piece for s in states for piece in s[cls.PIECES]],
                cls.RANKS: None,
                SHARE: None,
                UPSTREAM: upstream,
            },
        )


def decode_pieces(state: State, where: str) -> list[Piece]:
    """The pieces of a checked pack node, decoded; each must be a non-empty 1-D integer array.

    Raises:
        StateError: naming the piece that is not.
    """
    pieces = []
    for index, (data, first) in enumerate(state[_PackIterator.PIECES]):
        try:
            tokens = decode(data)
        except StateError as error:
            raise StateError(f"{where}: state['pieces'][{index}]: {error}") from None
        if type(tokens) is not np.ndarray or tokens.ndim != 1 or tokens.dtype.kind not in "iu" or not len(tokens):
            raise StateError(
                f"{where}: state['pieces'][{index}] must hold a non-empty 1-D integer numpy array, got {short(tokens)}"
            )
        if first > INT64_MAX - len(tokens):  # its last token's position_ids entry would wrap round to negative
            raise StateError(
                f"{where}: state['pieces'][{index}] starts at position {first}, so its {len(tokens)} tokens' "
                f"positions pass {INT64_MAX} (int64); the state was edited or is corrupt"
            )
        pieces.append((tokens, first))
    return pieces
