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
What is not yet in a block is the stage's state: a list of *pieces*, each a
token array (saved encoded, in its own dtype) and the position of its first
token in its document.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardkit.errors import ShardkitError
from shardkit.planning.fitting import FitIndex
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
    if type(sample) is dict:  # the common case, checked without the ABC machinery of isinstance(Mapping)
        value = sample.get(key)
        if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu" and value.size:
            return value
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


def token_dtype(dtype: Any, error: type[Exception] = PackError) -> np.dtype | None:
    """The numpy integer dtype ``pack(dtype=)`` names (a numpy dtype, its name, or a torch integer dtype
    that numpy has), or None for None (keep the documents' own).

    Raises:
        error: not an integer dtype both numpy and torch hold.
    """
    if dtype is None:
        return None
    try:
        found = torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    except (TypeError, RuntimeError):
        found = None
    if found is None or found.kind not in "iu":
        raise error(
            f"pack(dtype) must be an integer dtype torch holds (np.int32, np.uint16, torch.int64, ...) or None "
            f"to keep the documents' own, got {dtype!r}"
        )
    return found.newbyteorder("=")


def check_fits(tokens: np.ndarray, dtype: np.dtype, asked: bool) -> None:
    """Raise unless every token of ``tokens`` is exactly representable in ``dtype`` (the blocks' dtype).

    Raises:
        PackError: naming the token, the dtype and ``dtype=``.
    """
    if np.can_cast(tokens.dtype, dtype, "safe"):
        return
    info = np.iinfo(dtype)
    low, high = int(tokens.min()), int(tokens.max())
    if low >= info.min and high <= info.max:
        return
    bad = low if low < info.min else high
    why = f"pack(dtype={dtype})" if asked else f"the blocks' dtype {dtype} (that of the first document)"
    raise PackError(
        f"token {bad} of a {tokens.dtype} document does not fit {why}; pass pack(dtype=) a dtype that holds "
        "every token id, e.g. dtype=np.int64"
    )


def block(
    parts: Sequence[Piece],
    seq_len: int,
    pad_id: int,
    dtype: np.dtype,
    *,
    position_ids: bool = False,
    document_ids: bool = False,
) -> dict[str, torch.Tensor]:
    """One packed block from ``parts`` (at most ``seq_len`` tokens in all, each fitting ``dtype``), padded at
    the end: ``input_ids`` in ``dtype`` and, when asked, ``position_ids`` and ``document_ids`` (int64).

    Each row is a handful of numpy calls (the cost of a block is their overhead, not its tokens).
    """
    lengths = [len(tokens) for tokens, _ in parts]
    used = sum(lengths)
    input_ids = np.empty(seq_len, dtype)
    if parts:
        np.concatenate([tokens for tokens, _ in parts], out=input_ids[:used], casting="unsafe")  # fit: checked
    input_ids[used:] = pad_id
    out = {"input_ids": torch.from_numpy(input_ids)}
    if position_ids:
        # A token's position is its index in the block less where its piece starts, plus the piece's first position.
        shifts, start = [], 0
        for length, (_, first) in zip(lengths, parts):
            shifts.append(start - first)
            start += length
        positions = np.arange(seq_len, dtype=np.int64)
        positions[:used] -= np.repeat(np.array(shifts, np.int64), lengths)
        positions[used:] -= used  # the padding counts from 0, like a document of its own
        out["position_ids"] = torch.from_numpy(positions)
    if document_ids:
        documents = np.full(seq_len, PAD_DOCUMENT, np.int64)
        documents[:used] = np.repeat(np.arange(len(parts), dtype=np.int64), lengths)
        out["document_ids"] = torch.from_numpy(documents)
    return out


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
        dtype: np.dtype | None = None,
        position_ids: bool = False,
        document_ids: bool = False,
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
        dtype = self._dtype if self._dtype is not None else self._first_dtype(parts[0][0].dtype)
        for tokens, _ in parts:
            if tokens.dtype != dtype:
                check_fits(tokens, dtype, self._asked_dtype)
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
        """Fill the buffer, then open a block with its oldest piece and add the longest that fit
        (the choice :func:`~shardkit.planning.fitting.best_fit_blocks` makes of the lengths)."""
        while len(self._buffer) < self._buffer_size and (read := self._read()) is not None:
            self._add_document(read)
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

    def _add_document(self, tokens: np.ndarray) -> None:
        """Buffer a document, cut into ``seq_len`` pieces if longer."""
        if len(tokens) <= self._seq_len:
            self._add((tokens, 0))
            return
        for first in range(0, len(tokens), self._seq_len):
            self._add((tokens[first : first + self._seq_len], first))

    def _add(self, piece: Piece) -> None:
        arrival = self._arrivals
        self._arrivals += 1
        self._buffer[arrival] = piece
        self._index.add(arrival, len(piece[0]))

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
