"""Builds the optional C tf.Example decoder (shardkit/formats/_example.c); everything else is in pyproject.toml.

The extension is optional: if it does not compile (no C compiler, no Python
headers) or numpy's headers are missing (a build without isolation and without
numpy), the install still succeeds and shardkit uses its pure-Python decoder
(``shardkit.formats.example.BACKEND`` says which one runs).
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup


def extensions() -> list[Extension]:
    try:
        import numpy as np
    except ImportError:
        print("shardkit: numpy is not importable at build time: the C decoder is skipped", file=sys.stderr)
        return []
    source = "shardkit/formats/_example.c"
    return [Extension("shardkit.formats._example", sources=[source], include_dirs=[np.get_include()], optional=True)]


setup(ext_modules=extensions())
