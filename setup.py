"""Builds the optional C tf.Example decoder (shardkit/formats/_example.c); everything else is in pyproject.toml.

The extension is optional: if it does not compile (no C compiler, no Python
headers), the install still succeeds and shardkit uses its pure-Python decoder.
"""

from __future__ import annotations

import numpy as np
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardkit.formats._example",
            sources=["shardkit/formats/_example.c"],
            include_dirs=[np.get_include()],
            optional=True,
        )
    ]
)
