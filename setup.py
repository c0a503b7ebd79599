"""Builds the optional C extensions; everything else is in pyproject.toml.

- ``shardkit/formats/_example.c``: the tf.Example decoder
  (``shardkit.formats.example.BACKEND`` says whether it runs);
- ``shardkit/formats/_tfrecord.c``: the TFRecord framing and CRC-32C kernel
  (``shardkit.formats.tfrecord.kernel.BACKEND``).

Both are optional: if one does not compile (no C compiler, no Python headers)
or numpy's headers are missing (a build without isolation and without numpy:
the decoder needs them), the install still succeeds and shardkit uses its
pure-Python code in its place.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup


def extensions() -> list[Extension]:
    kernel = Extension("shardkit.formats._tfrecord", sources=["shardkit/formats/_tfrecord.c"], optional=True)
    try:
        import numpy as np
    except ImportError:
        print("shardkit: numpy is not importable at build time: the C decoder is skipped", file=sys.stderr)
        return [kernel]
    source = "shardkit/formats/_example.c"
    decoder = Extension("shardkit.formats._example", sources=[source], include_dirs=[np.get_include()], optional=True)
    return [decoder, kernel]


setup(ext_modules=extensions())
