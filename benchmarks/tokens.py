"""Megatron-LM token files: reading documents (shardkit, numpy, megatron-core) and packing blocks (shardkit, LitData).

Part ``read``: one run writes one ``.bin``/``.idx`` pair of ``--docs`` documents with
lognormal lengths (median ~400 tokens, uint16) and reads every document of it, from the
page cache, in one process:

- ``MegatronFormat.read``: the format alone (pread spans, a view per document);
- ``TokenDataset``: the dataset (plan, accounting), in order and ``shuffle=True``;
- a numpy memory map sliced by the checked index: the lower bound of per-document work;
- megatron-core's ``IndexedDataset[i]`` (memory map), when it imports.

Each case runs ``--rounds`` times, interleaved, and the best is kept (2 shared
cores make the rest noise). Documents and tokens per second; the checksum
column is the tokens each case saw (all must agree).

Part ``blocks`` (target: shardkit >= 1.5x LitData): ``--tokens`` (50M) int32 tokens,
the same documents written by each system's own writer (``shardkit.TokenWriter``; LitData's
``litdata.optimize`` with ``TokensLoader()``, chunks of 2,049 x 8,012 tokens as its
pretraining example has them), loaded into blocks of 2,048 tokens, batch 8, 2 workers:
``TokenDataset(prefix).pack(2048)`` through ``MixedLoader`` against
``StreamingDataset(item_loader=TokensLoader(block_size=2048))`` through
``StreamingDataLoader``. Both loaders are made anew each round (their workers start
afresh), the rounds interleaved; tokens/s is the median, the ratio the median of the
rounds' ratios. LitData drops each chunk's short tail; shardkit packs every token once
(its blocks' padding is counted as LitData's dropped tokens are not: all positions of all
blocks). litdata is not in the dev extra (its torchvision is a CUDA build): install it
without dependencies into a directory and name it, never letting it pull torch::

    pip install --no-deps --target /tmp/litdata-pkg litdata
    python benchmarks/tokens.py --part blocks --litdata-dir /tmp/litdata-pkg

Without it, LitData is left out with a line saying why.

    python benchmarks/tokens.py [--part read|blocks|all] [--docs 50000] [--tokens 50000000] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import shardkit
from shardkit.formats.megatron import MegatronFormat, parse_index


def write_corpus(prefix: str, docs: int) -> int:
    """Write ``docs`` documents of lognormal lengths (median ~400) to ``prefix``; return their tokens."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, docs).astype(int), 1, 16384)
    with shardkit.TokenWriter(prefix, dtype=np.uint16) as writer:
        for n in lengths:
            writer.write(rng.integers(0, 50_000, n, dtype=np.uint16))
    return int(lengths.sum())


def cases(prefix: str) -> dict[str, Callable[[], int]]:
    def fmt() -> int:
        return sum(len(r["input_ids"]) for r in MegatronFormat().read(prefix))

    def dataset(shuffle: bool) -> Callable[[], int]:
        return lambda: sum(len(r["input_ids"]) for r in shardkit.TokenDataset(prefix, shuffle=shuffle))

    def memmap() -> int:
        index = parse_index(open(prefix + ".idx", "rb").read(), prefix + ".idx")
        tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
        return sum(len(tokens[a:b]) for a, b in zip((index.starts // 2).tolist(), (index.ends // 2).tolist()))

    found = {
        "shardkit MegatronFormat.read": fmt,
        "shardkit TokenDataset": dataset(False),
        "shardkit TokenDataset shuffle=True": dataset(True),
        "numpy memmap sliced by the index": memmap,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError:
        return found

    def megatron() -> int:
        data = IndexedDataset(prefix)
        return sum(len(data[i]) for i in range(len(data)))  # one sequence per document here

    return {**found, "megatron-core IndexedDataset[i]": megatron}


def read_part(args: argparse.Namespace) -> None:
    docs, rounds = (2_000, 1) if args.quick else (args.docs, args.rounds)
    with tempfile.TemporaryDirectory() as root:
        prefix = os.path.join(root, "corpus")
        tokens = write_corpus(prefix, docs)
        todo = cases(prefix)
        best = dict.fromkeys(todo, float("inf"))
        seen = {}
        for _ in range(rounds):
            for name, run in todo.items():
                start = time.perf_counter()
                seen[name] = run()
                best[name] = min(best[name], time.perf_counter() - start)
    print(f"{docs} documents, {tokens} tokens (uint16), best of {rounds}\n")
    print("| reader | documents/s | tokens/s | tokens seen |")
    print("| --- | --- | --- | --- |")
    for name, seconds in best.items():
        print(f"| {name} | {docs / seconds:,.0f} | {tokens / seconds / 1e6:,.0f} M | {seen[name]} |")


# -- blocks: TokenDataset -> .pack -> MixedLoader against LitData's TokensLoader ----------------------------------

TARGET = 1.5  # the target: shardkit's blocks at least 1.5x as fast as LitData's


def write_both(root: str, tokens: int, dtype: np.dtype) -> tuple[str, str, int]:
    """The same documents (lognormal lengths, median ~400) as a Megatron pair written by ``TokenWriter``
    and as LitData chunks written by ``litdata.optimize`` (empty string when litdata is absent).
    Returns the prefix, the LitData directory and the tokens written."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, tokens // 300).astype(np.int64), 1, 16384)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    flat = rng.integers(0, 50_000, int(lengths.sum()), dtype=dtype)
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    prefix = os.path.join(root, "tokens")
    with shardkit.TokenWriter(prefix, dtype=dtype) as writer:
        for doc in docs:
            writer.write(doc)
    return prefix, _write_litdata(root, docs), int(lengths.sum())


def _write_litdata(root: str, docs: list[np.ndarray]) -> str:
    try:
        import litdata
        import torch
        from litdata.streaming.item_loader import TokensLoader
    except ImportError as error:
        print(f"LitData left out: {error} (install it with --no-deps into a directory, then --litdata-dir DIR)")
        return ""
    out = os.path.join(root, "litdata")
    groups = 16

    def documents(group: int) -> Iterator[Any]:
        for doc in docs[group::groups]:
            yield torch.from_numpy(doc)

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        litdata.optimize(  # the chunk size of LitData's own pretraining example (tokens: 8,012 blocks of 2,049)
            fn=documents, inputs=list(range(groups)), output_dir=out, chunk_size=2049 * 8012,
            item_loader=TokensLoader(), num_workers=1, start_method="fork",
        )  # fmt: skip
    return out


def block_loaders(prefix: str, litdata_dir: str, seq_len: int, batch: int, workers: int) -> dict[str, Any]:
    """Each loader as a function that makes it anew (workers started afresh every round for both)."""

    def shardkit_blocks() -> Any:
        blocks = shardkit.TokenDataset(prefix).pack(seq_len)
        return shardkit.MixedLoader(blocks, batch_size=batch, num_workers=workers)

    found: dict[str, Any] = {"shardkit TokenDataset.pack + MixedLoader": shardkit_blocks}
    if litdata_dir:
        import litdata
        from litdata.streaming.item_loader import TokensLoader

        def litdata_blocks() -> Any:
            dataset = litdata.StreamingDataset(litdata_dir, item_loader=TokensLoader(block_size=seq_len))
            return litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)

        found["litdata TokensLoader + StreamingDataLoader"] = litdata_blocks
    return found


def epoch_tokens(loader: Any) -> tuple[int, str]:
    """Tokens of one epoch of ``loader`` (every position of every block) and the blocks' dtype."""
    seen, dtype = 0, "?"
    for batch in loader:
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        seen += ids.numel()
        dtype = str(ids.dtype)
    return seen, dtype


def blocks_part(args: argparse.Namespace) -> None:
    tokens = 2_000_000 if args.quick else args.tokens
    rounds = 1 if args.quick else args.rounds
    dtype = np.dtype(args.dtype)
    with tempfile.TemporaryDirectory() as root:
        prefix, litdata_dir, written = write_both(root, tokens, dtype)
        loaders = block_loaders(prefix, litdata_dir, args.seq_len, args.batch_size, args.workers)
        seconds: dict[str, list[float]] = {name: [] for name in loaders}
        seen: dict[str, tuple[int, str]] = {}
        for make in loaders.values():  # each system's lazy imports and first worker start are no round's time
            next(iter(make()))
        for _ in range(rounds):
            for name, make in loaders.items():
                start = time.perf_counter()
                seen[name] = epoch_tokens(make())
                seconds[name].append(time.perf_counter() - start)
    print(
        f"\n{written:,} {dtype} tokens in blocks of {args.seq_len}, batch {args.batch_size}, {args.workers} workers, "
        f"median of {rounds} interleaved rounds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
    )
    print("| loader | tokens/s (median) | tokens per epoch | block dtype |")
    print("| --- | ---: | ---: | --- |")
    for name, times in seconds.items():
        print(
            f"| {name} | {seen[name][0] / statistics.median(times) / 1e6:,.1f} M | {seen[name][0]:,} | {seen[name][1]} |"
        )
    if len(loaders) == 2:
        mine, theirs = seconds.values()
        (mine_tokens, _), (their_tokens, _) = seen.values()
        ratios = [(mine_tokens / a) / (their_tokens / b) for a, b in zip(mine, theirs)]
        ratio = statistics.median(ratios)
        verdict = "met" if ratio >= TARGET else "NOT met"
        rounds_text = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"\nshardkit / LitData tokens/s: {ratio:.2f}x (rounds {rounds_text}); target >= {TARGET}x: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["read", "blocks", "all"], default="all")
    parser.add_argument("--docs", type=int, default=50_000, help="read: documents")
    parser.add_argument("--tokens", type=int, default=50_000_000, help="blocks: tokens")
    parser.add_argument("--dtype", default="int32", help="blocks: the token files' dtype")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--litdata-dir", help="a directory litdata was installed into (pip install --no-deps --target)")
    parser.add_argument("--quick", action="store_true", help="read: 2,000 documents; blocks: 2M tokens; one round")
    args = parser.parse_args()
    if args.litdata_dir:
        sys.path.insert(0, args.litdata_dir)
    if args.part in ("read", "all"):
        read_part(args)
    if args.part in ("blocks", "all"):
        blocks_part(args)


if __name__ == "__main__":
    main()
