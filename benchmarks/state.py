"""What saving samples as plain data costs, against the pickle it replaced.

A ``.shuffle(n)`` buffer is encoded into every state, and under a resumable
MixedLoader into every micro-batch message, so its encoding cost is paid per
message. This times :func:`shardkit.state.encode` / ``decode`` over a whole
buffer of samples against what shardkit did before (``torch.save`` of the
buffer, base64; ``torch.load(weights_only=False)`` to read it back), as
medians of interleaved rounds, and prints the JSON size of each.

    python benchmarks/state.py [--samples 1000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
