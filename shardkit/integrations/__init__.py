"""Glue between shardkit loaders and the trainers that checkpoint them.

Each module here imports its trainer when it is imported, so ``import shardkit``
never needs one: :mod:`shardkit.integrations.hf` (the Hugging Face ``Trainer``)
is imported by name, by the code that uses it. Nothing in shardkit imports
this package; it sits above every layer and uses only public loader and state
methods.
"""
