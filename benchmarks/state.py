"""What saving samples as plain data costs, against the pickle it replaced.

A ``.shuffle(n)`` buffer that cannot be saved as positions is encoded into every
state (under a resumable MixedLoader, every state a worker sends), so its encoding
cost is paid per state. This times :func:`shardkit.state.encode` / ``decode`` over a whole
buffer of samples against what shardkit did before (``torch.save`` of the
buffer, base64; ``torch.load(weights_only=False)`` to read it back), as
medians of interleaved rounds, and prints the JSON size of each.

Then what resumability costs a MixedLoader on the quickstart path
(``benchmarks/stalls.py``'s pipeline: a shuffled TFRecord source, a map, a
``.shuffle(256)``; 2 workers, batch 64), epochs interleaved: a state with every
micro-batch (as MixedLoader sent it before), states only when ``state_dict()`` asks
(``shardkit.loader.micro_batches``, the default), and ``resumable=False``; samples
per second, CPU seconds per million samples (main process and workers), and what
``state_dict()`` mid-epoch costs (it may receive micro-batches ahead and
carries the undelivered ones) and weighs as JSON.

First, what a state weighs per rank (pickled, as a trainer's checkpoint holds it) after 30% of an
epoch of samples decoded by a ``.map``, against issue 39's targets: at most 4 KB without a
buffer, at most 16 bytes more per held record with a ``.shuffle(n)`` buffer (held records are
saved as their positions, ``shardkit.stateful.positions``). And what a packed-tokens state weighs:
``TokenDataset.pack(2048)`` (50M-token-like lognormal documents, int32) through ``MixedLoader`` (2
workers, batch 8) as ``torch.save`` writes it (target: at most 4 KB per rank), its pack nodes alone
and the micro-batches the loader carries; and ``.pack(2048, strategy="best_fit")`` (256 documents
held) over records (target: at most 4 KB plus 16 bytes per held piece). And a
``MixedLoader(batch_size=50, num_workers=2)``'s state over 2,400 records of 100 KB, saved after
each of the steps around 30% of the epoch (where the batch boundary falls decides how much of the
workers' micro-batches is carried undelivered; the largest state counts).

Last, the resumable ratios against their targets, medians of interleaved rounds with the load
average beside them: MixedLoader ``resumable=True`` over ``resumable=False`` on the quickstart
path (target >= 0.97x), and over a plain DataLoader on 3x224x224 uint8 images made by a
``.map`` (target >= 1.0x). And, as wall-clock ratios cannot be judged on a busy machine, what
resumable adds per sample in a worker call by call, in CPU time (the position log; the positions
in each message), now and as it was before issue 39's item 3, against the 3% the 0.97x target leaves.

    python benchmarks/state.py [--samples 1000] [--rounds 15] [--loader-rounds 5] [--records 20000] [--tokens 5000000]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import islice
from typing import Any

import numpy as np
import torch
from stalls import cpu_seconds, in_process, to_tensors, write  # noqa: I001 - the sibling script, run from benchmarks/

import shardkit
from shardkit.loader.micro_batches import PositionLog, positions_of
from shardkit.state import decode, encode


def pickled(buffer: list[Any]) -> str:
    out = io.BytesIO()
    torch.save(buffer, out)
    return base64.b64encode(out.getvalue()).decode("ascii")


def unpickled(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


def buffers(samples: int) -> dict[str, list[Any]]:
    return {
        "1 KB bytes": [bytes(range(256)) * 4 for _ in range(samples)],
        "small dicts": [{"id": i, "text": f"hello world {i}", "label": i % 10} for i in range(samples)],
        "(3x32x32 uint8 tensor, int)": [(torch.zeros(3, 32, 32, dtype=torch.uint8), i) for i in range(samples)],
    }


def median_ms(functions: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(rounds):  # interleaved, so load on the machine hits every variant alike
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def mixed_loader(shards: shardkit.ShardList, case: str) -> shardkit.MixedLoader:
    pipeline = shardkit.TFRecordDataset(shards, shuffle=True, seed=0, balance="pad").map(to_tensors).shuffle(256)
    built = shardkit.MixedLoader(
        pipeline, batch_size=64, num_workers=2, persistent_workers=True, resumable=case != "resumable=False"
    )
    if case == "a state with every micro-batch":
        assert built._micro_batches is not None
        built._micro_batches.state_every = 1
    return built


def loader_epoch(built: shardkit.MixedLoader, save_at: int) -> tuple[float, float, float, int]:
    """(samples/s, CPU s per million samples, ms of one state_dict() at step ``save_at``, its JSON bytes)."""
    start, cpu, samples, saved, size = time.perf_counter(), cpu_seconds(built), 0, 0.0, 0
    for step, batch in enumerate(built, 1):
        samples += len(batch["label"])
        if step == save_at and built.resumable:
            began = time.perf_counter()
            state = built.state_dict()
            saved = (time.perf_counter() - began) * 1e3
            size = len(json.dumps(state))
    wall = time.perf_counter() - start
    return samples / wall, (cpu_seconds(built) - cpu) / samples * 1e6, saved, size


def loader_table(records: int, rounds: int) -> None:
    """The quickstart path's cases, interleaved; the resumable ratio (median of the rounds') against 0.97x."""
    cases = ("a state with every micro-batch", "states when asked", "resumable=False")
    print(f"\nMixedLoader, quickstart path, {records:,} records, {rounds} interleaved rounds, 2 workers, batch 64")
    print("| case | samples/s | CPU s/M samples | state_dict() ms | state JSON kB |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        shards = write(root, records)
        loaders = {case: mixed_loader(shards, case) for case in cases}
        results: dict[str, list[tuple[float, float, float, int]]] = {case: [] for case in cases}
        for built in loaders.values():  # warm-up: starts the persistent workers
            loader_epoch(built, 0)
        loads = []
        for round_ in range(rounds):
            for case in cases if round_ % 2 == 0 else cases[::-1]:
                results[case].append(loader_epoch(loaders[case], records // 64 // 2))
            loads.append(os.getloadavg()[0])
    for case in cases:
        rate, cpu, saved, size = (statistics.median(column) for column in zip(*results[case]))
        state = f"{saved:.1f} | {size / 1e3:.0f}" if saved else "- | -"
        print(f"| {case} | {rate:,.0f} | {cpu:.1f} | {state} |")
    resumable, plain = results["states when asked"], results["resumable=False"]
    ratio = statistics.median(a[0] / b[0] for a, b in zip(resumable, plain))
    cpu = statistics.median(b[1] / a[1] for a, b in zip(resumable, plain))
    print(
        f"resumable=True / resumable=False: {ratio:.2f}x samples/s, {cpu:.2f}x by CPU per sample "
        f"(target >= 0.97x; {_verdict(ratio, 0.97, loads)}), load average {min(loads):.1f}-{max(loads):.1f}"
    )


def logged_ns(rounds: int, records: int = 20_000) -> dict[str, float]:
    """CPU nanoseconds per sample that a resumable worker's position log adds (the root noting each
    position, ``take()`` making each micro-batch's bytes), on a cheap pipeline where it is a large
    share: a ``.shuffle(256)`` over records that are their own index; and what the log before issue
    39's item 3 added (a generator reading ``position`` around the root, an int64 array per
    micro-batch). Runs alternate; the fastest of each kind is compared (other processes only add time)."""
    counts = [records // 4] * 4
    urls = [f"pos/{i}/{sum(counts[:i])}-{n}" for i, n in enumerate(counts)]
    times: dict[str, list[float]] = {"none": [], "now": [], "before": []}
    for _ in range(rounds):
        for kind, runs in times.items():
            source = shardkit.ShardedDataset(shardkit.ShardList(urls, num_records=counts), _positional, shuffle=True)
            pipeline = source.shuffle(256)
            samples: Any = iter(pipeline)
            log = PositionLog.of(pipeline, samples) if kind != "none" else None
            if log is not None:
                samples = log.logged(samples) if kind == "now" else log._noted(samples)
            start, pulled = time.process_time(), 0
            while chunk := list(islice(samples, 64)):
                pulled += len(chunk)
                if log is not None and kind == "now":
                    log.take(len(chunk))
                elif log is not None:  # as before: an int64 array of the positions
                    taken = log._positions[: len(chunk)]
                    del log._positions[: len(chunk)]
                    np.array(taken, dtype=np.int64) if None not in taken else None
            runs.append((time.process_time() - start) / pulled * 1e9)
    return {kind: min(times[kind]) - min(times["none"]) for kind in ("now", "before")}


def positions_message_ns(messages: int = 50_000) -> dict[str, float]:
    """CPU nanoseconds a micro-batch's 64 positions add to its message, sent through DataLoader's queue
    (ForkingPickler) and received: now as bytes (viewed by positions_of), before as an int64 array."""
    from multiprocessing.reduction import ForkingPickler

    array = np.arange(1 << 33, (1 << 33) + 64, dtype=np.int64)
    cost = {}
    for kind, carried in (("none", None), ("now", array.tobytes()), ("before", array)):
        message = (0, 64, None, None, None, carried)
        start = time.process_time()
        for _ in range(messages):
            received = pickle.loads(ForkingPickler.dumps(message))[5]
            if kind == "now":
                positions_of(received)
        cost[kind] = time.process_time() - start
    return {kind: (cost[kind] - cost["none"]) / messages * 1e9 for kind in ("now", "before")}


def worker_calls(records: int, quick: bool) -> None:
    """What resumable adds per sample in a worker, call by call (CPU time, which a shared machine
    disturbs far less than wall time), against the 3% that the 0.97x target leaves."""
    with tempfile.TemporaryDirectory() as root:
        shards = write(root, records)
        plain = in_process(shards, 3 if quick else 9)[0]
    noted = logged_ns(3 if quick else 15)
    message = positions_message_ns(2_000 if quick else 50_000)
    for kind in ("before", "now"):
        per_sample = noted[kind] + message[kind] / 64
        share = per_sample * plain / 1e9
        verdict = "within" if share <= 0.03 else "OVER"
        print(
            f"{'' if kind == 'now' else chr(10)}resumable in a worker, call by call, {kind} (micro-batches of 64): "
            f"the position log {noted[kind]:.0f} ns per sample, the positions in each message "
            f"{message[kind]:,.0f} ns: {per_sample:.0f} ns per sample, {share:.2%} of the quickstart path's "
            f"{1e9 / plain:,.0f} ns per sample in one process (budget of the 0.97x target: 3%; {verdict}); "
            f"load {os.getloadavg()[0]:.1f}"
        )


def _verdict(ratio: float, target: float, loads: list[float]) -> str:
    cores = os.cpu_count() or 1
    if max(loads) > 1.5 * cores:
        return f"not judged: load above {1.5 * cores:.0f} on {cores} cores"
    return "met" if ratio >= target else "NOT met"


def _image(i: int) -> torch.Tensor:
    return torch.full((3, 224, 224), i % 251, dtype=torch.uint8)


def image_table(records: int, rounds: int) -> None:
    """MixedLoader resumable=True against resumable=False and a plain DataLoader, 3x224x224 uint8 images."""
    counts = [records // 4] * 4
    urls = [f"pos/{i}/{sum(counts[:i])}-{n}" for i, n in enumerate(counts)]

    def dataset() -> shardkit.Pipeline:
        return shardkit.ShardedDataset(shardkit.ShardList(urls, num_records=counts), _positional, shuffle=True).map(
            _image
        )

    loaders: dict[str, Any] = {
        "MixedLoader resumable=True": shardkit.MixedLoader(dataset(), 32, num_workers=2, persistent_workers=True),
        "MixedLoader resumable=False": shardkit.MixedLoader(
            dataset(), 32, num_workers=2, persistent_workers=True, resumable=False
        ),
        "DataLoader": torch.utils.data.DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True),
    }
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for built in loaders.values():
        for _ in built:  # warm-up: starts the persistent workers
            pass
    loads = []
    for round_ in range(rounds):
        for name in loaders if round_ % 2 == 0 else list(loaders)[::-1]:
            start, samples = time.perf_counter(), 0
            for batch in loaders[name]:
                samples += len(batch)
            rates[name].append(samples / (time.perf_counter() - start))
        loads.append(os.getloadavg()[0])
    print(f"\n3x224x224 uint8 images by a .map, {sum(counts):,} records, batch 32, 2 workers, {rounds} rounds")
    print("| loader | samples/s |\n|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):,.0f} |")
    ratio = statistics.median(a / b for a, b in zip(rates["MixedLoader resumable=True"], rates["DataLoader"]))
    print(
        f"MixedLoader resumable=True / DataLoader: {ratio:.2f}x (target >= 1.0x; {_verdict(ratio, 1.0, loads)}), "
        f"load average {min(loads):.1f}-{max(loads):.1f}"
    )


def _positional(url: str, start: int, stop: int | None) -> Any:
    first, count = map(int, url.rsplit("/", 1)[1].split("-"))
    return iter(range(first + start, first + (count if stop is None else min(stop, count))))


def _blob(i: int) -> dict[str, Any]:
    import numpy as np

    return {"id": i, "pixels": np.full((100, 1000), i % 251, np.uint8)}  # 100 KB decoded


def _tiny(i: int) -> dict[str, Any]:
    import numpy as np

    return {"id": i, "pixels": np.full(10, i % 251, np.uint8)}


def state_size_table(records: int) -> None:
    """Pickled state bytes per rank after 30% of an epoch, against the targets."""
    from shardkit.state import decode_positions

    counts = [records // 4] * 4
    urls = [f"pos/{i}/{sum(counts[:i])}-{n}" for i, n in enumerate(counts)]
    print(f"\nstate bytes per rank (pickled), {sum(counts):,} records, saved after 30% of the epoch")
    print("| pipeline | sample | held | state bytes | target | met |\n|---|---|---|---|---|---|")
    rows = [("no buffer (block shuffle)", _blob, None, 0), ("no buffer (sample-level window)", _blob, None, None)]
    rows += [(".shuffle(512)", _blob, 512, 0), (".shuffle(4096)", _tiny, 4096, 0)]
    for name, fn, buffer, window in rows:
        source = shardkit.ShardedDataset(shardkit.ShardList(urls, num_records=counts), _positional, shuffle=True)
        if window is not None:
            source.shuffle_window = window
        pipeline = source.map(fn) if buffer is None else source.map(fn).shuffle(buffer)
        iterator = iter(pipeline)
        for _ in range(int(0.3 * sum(counts))):
            next(iterator)
        state = pipeline.state_dict()
        size = len(pickle.dumps(state))
        held = len(decode_positions(state["positions"], "held")) if "positions" in state else 0
        target = 4096 + 16 * held
        sample = "100 KB" if fn is _blob else "10 B"
        print(f"| {name} | {sample} | {held} | {size:,} | <= {target:,} | {'yes' if size <= target else 'NO'} |")


def _document(i: int) -> dict[str, Any]:
    """Record ``i`` as a document of lognormal length (median 400 tokens), int32 ids."""
    import numpy as np

    rng = np.random.default_rng(i)
    return {"input_ids": rng.integers(0, 50_000, max(1, int(rng.lognormal(np.log(400), 1.0))), dtype=np.int32)}


def saved_bytes(state: Any) -> int:
    """The bytes ``torch.save`` writes for ``state``, as a trainer's checkpoint holds it."""
    out = io.BytesIO()
    torch.save(state, out)
    return len(out.getvalue())


def pack_nodes(state: Any) -> list[dict[str, Any]]:
    """Every pack node in ``state`` (a pipeline's or a loader's)."""
    if isinstance(state, dict):
        own = [state] if state.get("kind") == "pack" else []
        return own + [node for value in state.values() for node in pack_nodes(value)]
    if isinstance(state, list):
        return [node for value in state for node in pack_nodes(value)]
    return []


def held_pieces(node: dict[str, Any]) -> int:
    """Pieces a pack node holds, as data and by position."""
    from shardkit.state import decode_positions

    return len(node["pieces"]) + (len(decode_positions(node["positions"], "held")) if "positions" in node else 0)


def without_held(state: Any) -> Any:
    """``state`` with every pack node's held pieces left out (both forms)."""
    if isinstance(state, dict):
        drop = ("pieces", "positions", "starts", "identities") if state.get("kind") == "pack" else ()
        return {key: without_held(value) for key, value in state.items() if key not in drop}
    if isinstance(state, list):
        return [without_held(value) for value in state]
    return state


def pack_state_table(tokens: int) -> None:
    """Bytes per rank of packed-token states, saved after 30% of an epoch, against the targets."""
    import numpy as np

    print("\npacked-token state bytes per rank (torch.save), saved after 30% of the epoch")
    print(
        "| pipeline | pieces held | state bytes | of which held pieces (per piece) | of which carried | target | met |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        rng = np.random.default_rng(1)
        prefix, written = os.path.join(root, "tokens"), 0
        with shardkit.TokenWriter(prefix, dtype=np.int32) as writer:
            while written < tokens:
                doc = rng.integers(0, 50_000, max(1, int(rng.lognormal(np.log(400), 1.0))), dtype=np.int32)
                writer.write(doc)
                written += len(doc)
        loader = shardkit.MixedLoader(shardkit.TokenDataset(prefix).pack(2048), batch_size=8, num_workers=2)
        steps = int(0.3 * written / 2048 / 8)
        for step, _ in enumerate(loader, 1):
            if step == steps:
                state = loader.state_dict()
                break
        _pack_row("TokenDataset.pack(2048) + MixedLoader(2 workers)", state, 4096, 0)
    print(
        f"  (without the micro-batches MixedLoader carries: {saved_bytes({**state, 'carry': []}):,} bytes; "
        f"carried as {loader.stats().carried_as}: the workers' states are made at the delivered point)"
    )
    counts = [5000] * 4
    urls = [f"pos/{i}/{sum(counts[:i])}-{n}" for i, n in enumerate(counts)]
    source = shardkit.ShardedDataset(shardkit.ShardList(urls, num_records=counts), _positional, shuffle=True)
    source.shuffle_window = 0  # block shuffle: the source's own node is the position-only base
    pipeline = source.map(_document).pack(2048, strategy="best_fit")
    iterator = iter(pipeline)
    for _ in range(int(0.3 * sum(counts) * 400 / 2048)):
        next(iterator)
    state = pipeline.state_dict()
    _pack_row('records.map(doc).pack(2048, strategy="best_fit")', state, 4096, 16)


def _pack_row(name: str, state: Any, base: int, per_piece: int) -> None:
    nodes = pack_nodes(state)
    held = sum(held_pieces(node) for node in nodes)
    size = saved_bytes(state)
    packs = size - saved_bytes(without_held(state))
    carried = saved_bytes(state["carry"]) if isinstance(state, dict) and state.get("carry") else 0
    target = base + per_piece * held
    each = f" ({packs / held:.1f})" if held else ""
    met = "yes" if size <= target else "NO"
    print(f"| {name} | {held} | {size:,} | {packs:,}{each} | {carried:,} | <= {target:,} | {met} |")


def loader_state_table() -> None:
    """A MixedLoader's state bytes per rank (pickled) around 30% of the epoch, against the targets."""
    from shardkit.state import decode_positions

    counts = [600] * 4  # 2,400 records of 100 KB, as issue 39 measured
    urls = [f"pos/{i}/{sum(counts[:i])}-{n}" for i, n in enumerate(counts)]
    print("\nMixedLoader(batch_size=50, num_workers=2) state bytes per rank (pickled), 2,400 records of 100 KB,")
    print("saved after each of steps 14-17 of 48 (30%); the largest, with what it holds")
    print(
        "| pipeline | carried as | carried | shuffle-held | state bytes | target | met |\n|---|---|---|---|---|---|---|"
    )
    for name, buffer in (("no buffer (block shuffle)", None), (".shuffle(512)", 512)):
        source = shardkit.ShardedDataset(shardkit.ShardList(urls, num_records=counts), _positional, shuffle=True)
        source.shuffle_window = 0  # a sample-level window's unyielded intervals are the dataset's own state
        pipeline = source.map(_blob) if buffer is None else source.map(_blob).shuffle(buffer)
        built = shardkit.MixedLoader(pipeline, batch_size=50, num_workers=2)
        worst: tuple[int, int, int] = (0, 0, 0)
        for step, _ in enumerate(built, 1):
            if 14 <= step <= 17:
                state = built.state_dict()
                carried = sum(tail["count"] for tail in state["carry"])
                held = sum(len(decode_positions(w["positions"], "held")) for w in state["workers"] if "positions" in w)
                worst = max(worst, (len(pickle.dumps(state)), carried, held))
        size, carried, held = worst
        target = 4096 + 16 * (carried + held) if buffer else 4096
        met = "yes" if size <= target else "NO"
        form = getattr(built.stats(), "carried_as", None)
        print(f"| {name} | {form} | {carried} | {held} | {size:,} | <= {target:,} | {met} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--loader-rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--tokens", type=int, default=5_000_000, help="packed-token state: tokens in the file")
    parser.add_argument("--images", type=int, default=4_000)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    state_size_table(12_000)
    loader_state_table()
    pack_state_table(args.tokens)
    print(f"buffer of {args.samples} samples; ms per buffer (median of {args.rounds} interleaved rounds)")
    print(
        f"| {'samples':<28} | pickle enc | plain enc | ratio | pickle dec | plain dec | ratio | JSON kB pickle/plain |"
    )
    for name, buffer in buffers(args.samples).items():
        old, new = pickled(buffer), [encode(sample) for sample in buffer]
        ms = median_ms(
            {
                "pickle encode": lambda b=buffer: pickled(b),
                "plain encode": lambda b=buffer: [encode(s) for s in b],
                "pickle decode": lambda t=old: unpickled(t),
                "plain decode": lambda n=new: [decode(s) for s in n],
            },
            args.rounds,
        )
        enc, dec = ms["plain encode"] / ms["pickle encode"], ms["plain decode"] / ms["pickle decode"]
        sizes = f"{len(json.dumps(old)) / 1e3:.0f} / {len(json.dumps(new)) / 1e3:.0f}"
        print(
            f"| {name:<28} | {ms['pickle encode']:10.2f} | {ms['plain encode']:9.2f} | {enc:5.2f} "
            f"| {ms['pickle decode']:10.2f} | {ms['plain decode']:9.2f} | {dec:5.2f} | {sizes:>20} |"
        )

    loader_table(args.records, args.loader_rounds)
    worker_calls(args.records, quick=False)
    image_table(args.images, args.loader_rounds)


if __name__ == "__main__":
    main()
