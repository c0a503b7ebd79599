"""SVG as text: the few shapes the pictures draw, the colours they share, and an atomic write.

The command line's pictures (``shardkit plan --picture``, ``shardkit profile
--picture``, the docs' diagram of a glob's path to a batch) are SVG written by
this package, not by a plotting library: SVG is text, so a picture is a pure
function of what it shows, byte-identical from one run to the next (numbers are
printed with fixed decimals, nothing holds a date or a random id), and a test
can read the figures back from the elements' ``data-*`` attributes.

Everything here escapes what it writes (a shard's url may hold ``<`` or ``&``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape as _escape
from xml.sax.saxutils import quoteattr

from shardkit.errors import ShardkitError
from shardkit.tempfiles import probe_writable

#: One hue per rank (ColorBrewer's Set1/Dark2 blend: told apart in print and by most colour-blind readers).
RANK_HUES = ("#1f77b4", "#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#a6761d", "#e6ab02")
FONT = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"


class PictureError(ShardkitError, OSError):
    """A picture cannot be written where the user asked (exit code 2, one line)."""


def reader_colour(rank: int, worker: int, num_workers: int) -> str:
    """Rank ``rank``'s hue, lighter for each further worker: a rank's workers read as one family."""
    hue = RANK_HUES[rank % len(RANK_HUES)]
    red, green, blue = (int(hue[i : i + 2], 16) for i in (1, 3, 5))
    mix = 0.55 * worker / max(num_workers - 1, 1) if num_workers > 1 else 0.0
    red, green, blue = (round(c + (255 - c) * mix) for c in (red, green, blue))
    return f"#{red:02x}{green:02x}{blue:02x}"


def text_colour(fill: str) -> str:
    """Black or white, whichever reads better on ``fill``."""
    red, green, blue = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#000" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "#fff"


def num(value: float) -> str:
    """A coordinate as SVG text: two decimals at most, no ``-0``, the same text on every run."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def escape(text: str) -> str:
    return _escape(str(text))


def rect(
    x: float,
    y: float,
    width: float,
    height: float,
    fill: str,
    data: Mapping[str, object] | None = None,
    *,
    title: str | None = None,
    extra: str = "",
) -> str:
    """A ``<rect>``; ``data`` becomes ``data-*`` attributes (what a test reads back), ``title`` its tooltip."""
    attributes = "".join(f" data-{key}={quoteattr(str(value))}" for key, value in (data or {}).items())
    opening = (
        f'<rect x="{num(x)}" y="{num(y)}" width="{num(max(width, 0))}" height="{num(height)}" '
        f'fill="{fill}"{attributes}{extra}'
    )
    return f"{opening}/>" if title is None else f"{opening}><title>{escape(title)}</title></rect>"


def text(
    x: float,
    y: float,
    content: str,
    *,
    size: float = 12,
    anchor: str = "start",
    fill: str = "#222",
    weight: str = "normal",
) -> str:
    return (
        f'<text x="{num(x)}" y="{num(y)}" font-size="{num(size)}" text-anchor="{anchor}" fill="{fill}" '
        f'font-weight="{weight}">{escape(content)}</text>'
    )


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#999", width: float = 1) -> str:
    return f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" stroke="{stroke}" stroke-width="{num(width)}"/>'


#: The hatching that marks repeated (padding) and left-out (dropped) records.
HATCH_DEFS = (
    '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
    '<rect width="6" height="6" fill="none"/><line x1="0" y1="0" x2="0" y2="6" stroke="#000" stroke-width="2" '
    'stroke-opacity="0.45"/></pattern></defs>'
)


def document(width: float, height: float, body: Sequence[str], title: str) -> str:
    """A whole SVG file: white background, the hatch pattern, a ``<title>``, then ``body``."""
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(width)}" height="{num(height)}" '
            f'viewBox="0 0 {num(width)} {num(height)}" style="{FONT}">',
            f"<title>{escape(title)}</title>",
            HATCH_DEFS,
            f'<rect x="0" y="0" width="{num(width)}" height="{num(height)}" fill="#fff"/>',
            *body,
            "</svg>",
            "",
        ]
    )


def check_writable(path: str) -> None:
    """Fail now, before a run, if ``path`` cannot be written: a name ending in ``.svg``, whose folder exists
    and takes a new file (tried for real: permissions alone do not say, for root or on a read-only mount)."""
    if not path.lower().endswith(".svg"):
        raise PictureError(f"cannot write the picture to {path}: give a name ending in .svg (the pictures are SVG)")
    if os.path.isdir(path):
        raise PictureError(
            f"cannot write the picture to {path}: it is a directory; give a file name such as {path.rstrip('/')}/plan.svg"
        )
    try:
        probe_writable(path)
    except OSError as error:
        raise PictureError(f"cannot write the picture to {path}: {error.strerror or error}") from None


def write_atomic(path: str, content: str) -> None:
    """Write ``content`` to ``path``: a temporary file beside it, renamed into place (never a half picture)."""
    partial = _partial(path)
    try:
        with open(partial, "w", encoding="utf-8", newline="\n") as file:
            file.write(content)
        os.replace(partial, path)
    except OSError as error:
        if os.path.exists(partial):
            os.remove(partial)
        raise PictureError(f"cannot write the picture to {path}: {error.strerror or error}") from None


def _partial(path: str) -> str:
    return f"{path}.partial-{os.getpid()}"
