"""Reading Megatron-LM token files: shardkit against a numpy memory map and megatron-core.

One run writes one ``.bin``/``.idx`` pair of ``--docs`` documents with lognormal
lengths (median ~400 tokens, uint16) and reads every document of it, from the
page cache, in one process:

- ``MegatronFormat.read``: the format alone (pread spans, a view per document);
- ``TokenDataset``: the dataset (plan, accounting), in order and ``shuffle=True``;
- a numpy memory map sliced by the checked index: the lower bound of per-document work;
- megatron-core's ``IndexedDataset[i]`` (memory map), when it imports.

Each case runs ``--rounds`` times, interleaved, and the best is kept (2 shared
cores make the rest noise). Documents and tokens per second; the checksum
column is the tokens each case saw (all must agree).

    python benchmarks/tokens.py [--docs 50000] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from collections.abc import Callable

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2,000 documents, one round")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
