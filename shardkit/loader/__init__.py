"""MixedLoader: every DataLoader worker's samples mixed into every batch,
collated into shared-memory slabs."""

from shardkit.loader.mixed import LoaderError, MixedLoader

__all__ = ["LoaderError", "MixedLoader"]
