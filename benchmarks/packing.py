"""Packing documents into blocks: shardkit's ``.pack()`` against trl and Grain, tokens/s and fill.

Every packer gets the same documents: lognormal lengths (median 400 tokens,
sigma 1, as web text has them), int32 token ids, cut beforehand into pieces
of at most ``--seq-len`` (2048) tokens, because trl's ``"bfd"`` drops what
does not fit a block and Grain's packers refuse it. Packers:

* shardkit ``.pack(strategy="concat")`` and ``.pack(strategy="best_fit")``
  (default buffer, 256 documents), read through ``shardkit.wrap`` over the
  list: blocks of int32 tensors with ``document_ids=True`` (what tells a
  block's documents apart, as trl's ``seq_lengths`` and Grain's segment ids do);
* ``trl.data_utils.pack_dataset(strategy="bfd")`` over a ``datasets.Dataset``
  held in memory (best-fit decreasing over batches of 1,000 documents; rows
  of variable length with ``seq_lengths``, no padding, no tensors made);
* Grain's ``BestFitPackIterDataset`` (256 packing bins) over
  ``MapDataset.source``, blocks of int32 arrays with segment ids and positions.

Fill is real tokens over blocks times ``seq_len`` (a trl row shorter than
``seq_len`` counts as a block). Each packer packs everything once per round,
the packers taking turns; a row's tokens/s is the median over the rounds, its
ratio the median of the rounds' ratios of shardkit best_fit's time to its time.
A packer whose package is not installed is left out, with a line saying so.

    python benchmarks/packing.py            # 20,000 documents, 5 rounds
    python benchmarks/packing.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import shardkit

#: The targets: best-fit at least 1.5x trl's BFD at equal fill, and not behind Grain's packer.
TARGETS = {"trl pack_dataset bfd": 1.5, "Grain BestFitPackIterDataset": 1.0}

Packer = Callable[[list[np.ndarray], int], tuple[int, int]]  # (documents, seq_len) -> (blocks, real tokens)


def documents(count: int, seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """Lognormal documents (median 400 tokens) cut into pieces of at most ``seq_len``."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(400), 1.0, count).astype(np.int64))
    tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.int32)
    docs = np.split(tokens, np.cumsum(lengths)[:-1])
    return [doc[start : start + seq_len] for doc in docs for start in range(0, len(doc), seq_len)]


def shardkit_packer(strategy: str) -> Packer:
    def pack(docs: list[np.ndarray], seq_len: int) -> tuple[int, int]:
        source = shardkit.wrap([{"input_ids": doc} for doc in docs])
        blocks = pads = 0
        for block in source.pack(seq_len, strategy=strategy, document_ids=True):  # as trl's seq_lengths
            blocks += 1
            pads += int(np.count_nonzero(block["document_ids"].numpy() < 0))
        return blocks, blocks * seq_len - pads

    return pack


def trl_packer() -> Packer | None:
    try:
        import datasets
        from trl.data_utils import pack_dataset
    except ImportError as error:
        print(f"trl left out: {error}")
        return None
    datasets.disable_progress_bars()

    def pack(docs: list[np.ndarray], seq_len: int) -> tuple[int, int]:
        dataset = datasets.Dataset.from_dict({"input_ids": docs})  # in memory: not timed apart, a small share
        packed = pack_dataset(dataset, seq_len, strategy="bfd")
        lengths = packed.with_format("arrow").data.column("seq_lengths").to_pylist()
        return len(packed), sum(sum(row) for row in lengths)

    return pack


def grain_packer() -> Packer | None:
    logging.getLogger("absl").setLevel(logging.ERROR)  # "Failed to load jax profiler": Grain runs without jax
    try:
        import grain
        from grain.experimental import BestFitPackIterDataset
    except ImportError as error:
        print(f"Grain left out: {error}")
        return None

    def pack(docs: list[np.ndarray], seq_len: int) -> tuple[int, int]:
        source = grain.MapDataset.source([{"input_ids": doc} for doc in docs]).to_iter_dataset()
        packed = BestFitPackIterDataset(
            source, length_struct={"input_ids": seq_len}, num_packing_bins=256, shuffle_bins=False
        )
        blocks = real = 0
        for block in packed:
            blocks += 1
            real += int((block["input_ids_segment_ids"] > 0).sum())
        return blocks, real

    return pack


def run(packers: dict[str, Packer], docs: list[np.ndarray], seq_len: int, rounds: int) -> dict[str, Any]:
    """Seconds per round of each packer (taking turns), and its blocks and fill."""
    total = sum(len(doc) for doc in docs)
    seconds: dict[str, list[float]] = {name: [] for name in packers}
    fills: dict[str, tuple[int, float]] = {}
    for pack in packers.values():
        pack(docs[:200], seq_len)  # imports (torch's for shardkit, pyarrow's for trl) are no round's time
    for _ in range(rounds):
        for name, pack in packers.items():
            start = time.perf_counter()
            blocks, real = pack(docs, seq_len)
            seconds[name].append(time.perf_counter() - start)
            if real != total:
                raise SystemExit(f"{name} packed {real} tokens of {total}")
            fills[name] = blocks, real / (blocks * seq_len)
    return {"seconds": seconds, "fills": fills, "total": total}


def table(result: dict[str, Any], reference: str) -> str:
    seconds, fills, total = result["seconds"], result["fills"], result["total"]
    lines = [f"| packer | tokens/s | blocks | fill | {reference} is |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, times in seconds.items():
        ratio = statistics.median(other / mine for mine, other in zip(seconds[reference], times))
        blocks, fill = fills[name]
        rate = total / statistics.median(times)
        lines.append(f"| {name} | {rate:,.0f} | {blocks} | {fill:.4f} | {ratio:.2f}x as fast |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="1,000 documents, 1 round")
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    count, rounds = (1_000, 1) if args.quick else (args.docs, args.rounds)
    docs = documents(count, args.seq_len)
    packers: dict[str, Packer] = {
        "shardkit best_fit": shardkit_packer("best_fit"),
        "shardkit concat": shardkit_packer("concat"),
    }
    for name, make in (("trl pack_dataset bfd", trl_packer), ("Grain BestFitPackIterDataset", grain_packer)):
        packer = make()
        if packer is not None:
            packers[name] = packer
    result = run(packers, docs, args.seq_len, rounds)
    print(f"{len(docs)} documents, {result['total']:,} tokens, seq_len {args.seq_len}, median of {rounds} rounds\n")
    print(table(result, "shardkit best_fit"))
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cpus")
    for name, target in TARGETS.items():
        if name in result["seconds"]:
            ratios = [o / m for m, o in zip(result["seconds"]["shardkit best_fit"], result["seconds"][name])]
            ratio = statistics.median(ratios)
            rounds_text = ", ".join(f"{r:.2f}" for r in ratios)
            verdict = "met" if ratio >= target else "NOT met"
            print(f"shardkit best_fit / {name}: {ratio:.2f}x (rounds {rounds_text}); target >= {target}x: {verdict}")


if __name__ == "__main__":
    main()
