"""The iterator of ``.pack()``: documents (token arrays) packed into blocks of ``seq_len`` tokens.

Each block is ``{"input_ids": Tensor[seq_len]}``, the tokens in the
documents' own dtype (int32 and uint16 stay so; ``dtype=`` asks for
another), padded at the end with ``pad_id``. Two more rows, each a
``LongTensor[seq_len]``, come when asked: ``position_ids``, each token's
position in its document (0 at a document's start; a document split over
blocks goes on counting where it left off), and ``document_ids``, the index
of its document within the block (0, 1, ...), ``-1`` where the block is
padded. Padding positions count 0, 1, ... like a document of their own, so
both a block-diagonal mask (from ``document_ids``) and ``cu_seqlens`` (from
``position_ids``) keep them apart from the documents (see
``docs/pretraining.md``). They are off by default: a trainer that does not
mask across documents need not pay for (and ship to the main process) two
int64 rows per block beside a row of int32 tokens.

Two strategies:

* ``"concat"`` lays the documents end to end and cuts the stream every
  ``seq_len`` tokens: a document may start in one block and end in the
  next; only a reader's last block is padded.
* ``"best_fit"`` keeps every document whole (one longer than ``seq_len`` is
  cut into ``seq_len`` pieces and a shorter rest). It holds up to
  ``buffer_size`` documents; when the buffer is full, a block opens with
  the oldest piece (one with ``k`` older pieces is in one of the next
  ``k + 1`` blocks) and is filled with, again and again, the longest piece
  that still fits (:class:`~shardkit.planning.fitting.FitIndex` finds it
  with a bit mask over the lengths). With a buffer of hundreds of
  documents, blocks are above 99% full.

The work per document is a few dict and deque operations; tokens are only
sliced and copied by numpy (one ``concatenate`` into the block), never
touched one by one in Python. A token that does not fit the blocks' dtype
(a later document of a wider dtype than the first, or ``dtype=`` narrower
than the files) is an error naming ``dtype=``, never a silent wrap-round.

What is not yet in a block is the stage's state: its *pieces*, each a run of
one document's tokens, ``start`` the index of its first token in the document.
Where the input can read its records again (``Pipeline.records()``: shard
sources such as ``TokenDataset``, through maps, filters and shuffles; see
:mod:`shardkit.stateful.positions`) a piece is saved as the position of its
document's record and its ``start`` (its length follows: a concat piece is
the rest of its document, a best-fit piece at most ``seq_len`` of it), about
12 bytes a piece whatever its length, with a digest of each named shard's
identity; on restore the documents are read again (and mapped again) and cut
where they were. Where it cannot (a wrapped plain iterable, a ``.batch``,
``interleave`` or ``.repeat`` below, a padded stand-in record) the pieces are
saved as data: each token array encoded, in its own dtype.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from shardkit.pipeline.blocks import UNKNOWN, PackError, Piece, block, check_fits, tokens_of
from shardkit.planning.fitting import FitIndex
from shardkit.stateful import (
    DIGESTS,
    EPOCH,
    INT64_MAX,
    SEQUENCE,
    SHARDS,
    SHARE,
    UPSTREAM,
    Records,
    Resume,
    StageIterator,
    State,
    StateError,
    check_all_shares,
    check_identities,
    check_identities_field,
    check_inputs_epoch,
    check_share,
    combine_ranks,
    decode,
    decode_positions,
    encode,
    encode_positions,
    expect_equal,
    field,
    held_identities,
    merge,
    merge_identities,
    node,
    same_data,
    same_value,
    share_field,
    short,
    upstream_state,
    whole_number,
)
from shardkit.topology import Topology

#: What ``next(source, _END)`` returns once the input has ended.
_END = object()

#: The packing strategies ``.pack(strategy=...)`` takes.
STRATEGIES = ("concat", "best_fit")


class _PackIterator(StageIterator):
    """Blocks of ``seq_len`` tokens from the documents at ``key`` of the input's samples.

    State node (kind ``"pack"``): ``epoch``; ``strategy`` and ``seq_len``
    (a state loads only into the same packing); what has been read and not
    yet packed, oldest first, in two forms (see the module docstring):
    ``pieces``, those saved as data, each ``[tokens, start]`` (the token
    array encoded with :func:`~shardkit.state.encode` in the dtype it was
    read in, and the index of its first token in its document: non-zero for
    the rest of a document cut at a block's end); and, optional (absent in
    states of earlier shardkits), those saved by position: ``positions``
    (an encoded ``[n, 2]`` array of their documents' (shard, record), see
    :mod:`shardkit.stateful.positions`), ``starts`` (an encoded array of
    their starts) and ``identities`` (a digest of each named shard's
    identity, checked before the documents are read again). A worker's own
    node uses one form; a merged one may hold both (data pieces first).
    ``ranks``: None for one rank's node, else the number of ranks whose
    pieces a global node (:func:`~shardkit.state.merge_ranks`) pools;
    ``share``; ``upstream``. A merged node (``share`` None) pools the pieces
    of every worker; each rank of the world loading a global node takes
    every ``world_size``-th piece from its rank on, and each worker every
    ``num_workers``-th of its rank's. Pieces are dealt whole, so every token
    is packed exactly once; the blocks after such a restore are not the
    uninterrupted ones.
    """

    KIND = "pack"
    STRATEGY = "strategy"  #: state key: "concat" or "best_fit"
    SEQ_LEN = "seq_len"  #: state key: tokens per block
    PIECES = "pieces"  #: state key: the pieces saved as data, [encoded tokens, start] pairs
    POSITIONS = "positions"  #: state key (optional): the pieces saved by position: their documents' positions
    STARTS = "starts"  #: state key (with positions): each such piece's first token's index in its document
    IDENTITIES = "identities"  #: state key (with positions): the identities of the shards they name
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
        dtype: np.dtype | None = None,
        position_ids: bool = False,
        document_ids: bool = False,
        records: Records | None = None,
    ) -> None:
        self._source = source
        self._seq_len = seq_len
        self._key = key
        self._strategy = strategy
        self._pad_id = pad_id
        self._buffer_size = buffer_size
        self._epoch = epoch
        self._topology = topology
        self._asked_dtype = dtype is not None
        self._dtype = dtype  # None until the first block: then the dtype of its first piece
        self._rows = {"position_ids": position_ids, "document_ids": document_ids}
        self._exhausted = False
        # How the documents are read again, and whether the input says whose record each is; None: pieces as data.
        self._records = records if records is not None and hasattr(source, "position") else None
        # concat: the pieces waiting, in stream order.
        self._queue: deque[Piece] = deque()
        # best_fit: the pieces waiting by arrival number (a dict keeps arrival order: oldest first),
        # and their arrival numbers by length, to find the longest that fits.
        self._buffer: dict[int, Piece] = {}
        self._index = FitIndex()
        self._arrivals = 0

    # -- reading ---------------------------------------------------------------

    def _read(self) -> np.ndarray | None:
        """The next non-empty document of the input, or None once it has ended."""
        source, key = self._source, self._key
        while not self._exhausted:
            sample = next(source, _END)
            if sample is _END:
                self._exhausted = True
                break
            tokens = tokens_of(sample, key)
            if len(tokens):
                return tokens
        return None

    def _read_position(self) -> int:
        """The position of the record of the document read last (UNKNOWN where the input gives none)."""
        if self._records is None:
            return UNKNOWN
        position = self._source.position  # type: ignore[attr-defined]  # checked in __init__
        return UNKNOWN if position is None else position

    def __next__(self) -> dict[str, torch.Tensor]:
        parts = self._next_concat() if self._strategy == "concat" else self._next_best_fit()
        if not parts:
            raise StopIteration
        dtype = self._dtype if self._dtype is not None else self._first_dtype(parts[0][0].dtype)
        for piece in parts:
            if piece[0].dtype != dtype:
                check_fits(piece[0], dtype, self._asked_dtype)
        return block(parts, self._seq_len, self._pad_id, dtype, **self._rows)

    def _first_dtype(self, dtype: np.dtype) -> np.dtype:
        """Fix the blocks' dtype to the first piece's (native byte order), checking ``pad_id`` fits it."""
        dtype = dtype.newbyteorder("=")
        info = np.iinfo(dtype)
        if not info.min <= self._pad_id <= info.max:
            raise PackError(
                f"pack(pad_id={self._pad_id}) does not fit the documents' dtype {dtype}, which the blocks keep; "
                f"pass a pad_id in [{info.min}, {info.max}] or pack(dtype=) a dtype that holds it, e.g. dtype=np.int64"
            )
        self._dtype = dtype
        return dtype

    def _next_concat(self) -> list[Piece]:
        """The next ``seq_len`` tokens of the stream, cutting the piece that crosses the end: held pieces
        first (oldest first), then documents read."""
        parts: list[Piece] = []
        room = self._seq_len
        queue = self._queue
        while room and queue:
            tokens, start, position = queue.popleft()
            if len(tokens) > room:
                queue.appendleft((tokens[room:], start + room, position))
                tokens = tokens[:room]
            parts.append((tokens, start, UNKNOWN))
            room -= len(tokens)
        read = self._read
        while room and (tokens := read()) is not None:  # every document's path: no piece made for a whole one
            if len(tokens) > room:
                # Only a document cut here is held: its position is asked for now, not for every document read.
                queue.append((tokens[room:], room, self._read_position()))
                tokens = tokens[:room]
            parts.append((tokens, 0, UNKNOWN))
            room -= len(tokens)
        return parts

    def _next_best_fit(self) -> list[Piece]:
        """Fill the buffer, then open a block with its oldest piece and add the longest that fit
        (the choice :func:`~shardkit.planning.fitting.best_fit_blocks` makes of the lengths)."""
        while len(self._buffer) < self._buffer_size and (read := self._read()) is not None:
            self._add_document(read, self._read_position())
        if not self._buffer:
            return []
        buffer, index = self._buffer, self._index
        oldest = buffer.pop(next(iter(buffer)))
        index.remove_oldest(len(oldest[0]))
        parts = [oldest]
        room = self._seq_len - len(oldest[0])
        while room and (found := index.take_longest(room)) is not None:
            parts.append(buffer.pop(found[0]))
            room -= found[1]
        return parts

    def _add_document(self, tokens: np.ndarray, position: int) -> None:
        """Buffer a document (at ``position``), cut into ``seq_len`` pieces if longer."""
        if len(tokens) <= self._seq_len:
            self._add((tokens, 0, position))
            return
        for start in range(0, len(tokens), self._seq_len):
            self._add((tokens[start : start + self._seq_len], start, position))

    def _add(self, piece: Piece) -> None:
        arrival = self._arrivals
        self._arrivals += 1
        self._buffer[arrival] = piece
        self._index.add(arrival, len(piece[0]))

    def _pieces(self) -> list[Piece]:
        return list(self._queue) if self._strategy == "concat" else list(self._buffer.values())

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> State:
        """The pieces read and not yet packed, oldest first (by position where every one has one, else
        as data), and the input's node."""
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.STRATEGY: self._strategy,
                self.SEQ_LEN: self._seq_len,
                **self._held_fields(),
                self.RANKS: None,
                SHARE: share_field(self._topology),
                UPSTREAM: upstream_state(self._source),
            },
        )

    def _held_fields(self) -> dict[str, Any]:
        pieces = self._pieces()
        if self._records is None or any(piece[2] == UNKNOWN for piece in pieces):
            return {self.PIECES: [[encode(tokens), start] for tokens, start, _ in pieces]}
        positions = np.array([piece[2] for piece in pieces], dtype=np.int64)
        return {
            self.PIECES: [],
            self.POSITIONS: encode_positions(positions),
            self.STARTS: encode_starts([piece[1] for piece in pieces]),
            self.IDENTITIES: known_identities(self._records, positions),
        }

    def restore(self, resume: Resume) -> None:
        """Take up the saved pieces: all of a worker's own node; this rank's and worker's
        part of a merged one (see the class docstring). Pieces saved by position are cut
        again from their documents, read again after their shards' identities are checked."""
        state, owner = resume.state, resume.owner
        held: list[Any] = [*decode_pieces(state, repr(owner)), *saved_positions(state, repr(owner))]
        if state[self.RANKS] is not None:
            held = held[resume.topology.rank :: resume.topology.world_size]
        held = resume.part(held)
        if self.POSITIONS in state:
            held = self._refetch(held, state[self.IDENTITIES], owner)
        for piece in held:
            if self._strategy == "concat":
                self._queue.append(piece)
            else:
                self._add(piece)

    def _refetch(self, held: list[Any], identities: dict[str, Any], owner: object) -> list[Piece]:
        """``held`` with each (position, start) pair replaced by its piece, cut from its document read again."""
        wanted = [item for item in held if type(item) is tuple and len(item) == 2]
        if not wanted:
            return held
        if self._records is None:
            raise StateError(
                f"{owner!r}: the state holds the pack buffer's documents by position, but the input of this pack "
                "cannot read records again; load the state into the pipeline that saved it"
            )
        check_identities(self._records, identities, owner)
        positions, inverse = np.unique(np.array([p for p, _ in wanted], dtype=np.int64), return_inverse=True)
        documents = [tokens_of(sample, self._key) for sample in self._records.fetch(positions)]
        cut = iter([self._cut(documents[i], int(positions[i]), start, owner) for i, (_, start) in zip(inverse, wanted)])
        return [next(cut) if type(item) is tuple and len(item) == 2 else item for item in held]

    def _cut(self, tokens: np.ndarray, position: int, start: int, owner: object) -> Piece:
        """The piece of document ``tokens`` from ``start``: its rest (concat) or at most ``seq_len`` (best_fit)."""
        if start >= len(tokens):
            raise StateError(
                f"{owner!r}: the state holds the tokens of record {position & 0xFFFFFFFF} of shard {position >> 32} "
                f"from token {start} on, but read again it has {len(tokens)} tokens; the record (or a map before "
                "the pack) changed since the state was saved"
            )
        stop = len(tokens) if self._strategy == "concat" else start + self._seq_len
        return tokens[start:stop], start, position

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
        saved_positions(state, where)
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
            for index, (tokens, _, _) in enumerate(pieces):
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
        by_position = [s for s in states if cls.POSITIONS in s]
        held: dict[str, Any] = {}
        if by_position:
            pairs = [pair for s in by_position for pair in saved_positions(s, "merge()")]
            held = {
                cls.POSITIONS: encode_positions(np.array([p for p, _ in pairs], dtype=np.int64)),
                cls.STARTS: encode_starts([start for _, start in pairs]),
                cls.IDENTITIES: merge_identities([s[cls.IDENTITIES] for s in by_position]),
            }
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.STRATEGY: same_value(states, cls.STRATEGY),
                cls.SEQ_LEN: same_value(states, cls.SEQ_LEN),
                cls.PIECES: [piece for s in states for piece in s[cls.PIECES]],
                **held,
                cls.RANKS: None,
                SHARE: None,
                UPSTREAM: upstream,
            },
        )


def decode_pieces(state: State, where: str) -> list[Piece]:
    """The pieces a checked pack node holds as data, decoded; each must be a non-empty 1-D integer array.

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
        pieces.append((tokens, first, UNKNOWN))
    return pieces


def known_identities(records: Records, positions: np.ndarray) -> dict[str, list[Any]]:
    """:func:`~shardkit.stateful.held_identities` less the shards with no identity to check (a wrapped
    map-style dataset's items, each a shard of its own when shuffled: a held piece would pay for its entry)."""
    found = held_identities(records, positions)
    kept = [index for index, digest in enumerate(found[DIGESTS]) if digest]
    return {SHARDS: [found[SHARDS][i] for i in kept], DIGESTS: [found[DIGESTS][i] for i in kept]}


#: The largest start a piece saved by position may have (its tokens' position_ids stay far from int64's end).
MAX_START = 2**62


def encode_starts(starts: Sequence[int]) -> Any:
    """Pieces' starts as plain data: an encoded array of the narrowest unsigned dtype that holds them
    (best-fit starts are mostly 0: one byte each)."""
    largest = max(starts, default=0)
    dtype = next(d for d in ("<u1", "<u2", "<u4", "<u8") if largest <= np.iinfo(d).max)
    return encode(np.array(starts, dtype=dtype))


def saved_positions(state: State, where: str) -> list[tuple[int, int]]:
    """The (document position, start) of each piece a pack node holds by position ([] where none).

    Raises:
        StateError: ``positions``, ``starts`` and ``identities`` are not all there, or not of one length.
    """
    keys = (_PackIterator.POSITIONS, _PackIterator.STARTS, _PackIterator.IDENTITIES)
    present = [key in state for key in keys]
    if not any(present):
        return []
    if not all(present):
        raise StateError(f"{where}: a pack state holding pieces by position needs all of {list(keys)}")
    check_identities_field(field(state, _PackIterator.IDENTITIES, where, dict), where)
    positions = decode_positions(state[_PackIterator.POSITIONS], where)
    try:
        starts = decode(state[_PackIterator.STARTS])
    except StateError as error:
        raise StateError(f"{where}: state['starts']: {error}") from None
    if type(starts) is not np.ndarray or starts.ndim != 1 or starts.dtype.kind != "u" or len(starts) != len(positions):
        raise StateError(
            f"{where}: state['starts'] must be a 1-D unsigned array of one start per position "
            f"({len(positions)}), got {short(starts)}"
        )
    if len(starts) and int(starts.max()) > MAX_START:
        raise StateError(f"{where}: state['starts'] holds a start past {MAX_START}; the state was edited or is corrupt")
    return list(zip(positions.tolist(), starts.tolist()))
