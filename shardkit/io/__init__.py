"""Reading bytes from local and remote storage. Nothing here knows a shard format.

Layered bottom up, each module importing only those below it (the import-linter
contract in pyproject.toml): the transports (:mod:`~shardkit.io.http`,
:mod:`~shardkit.io.s3`); a file's identity (:mod:`~shardkit.io.identity`), the
read counters (:mod:`~shardkit.io.counters`) and globbing
(:mod:`~shardkit.io.glob`); retries (:mod:`~shardkit.io.retry`); the options a
read is given (:mod:`~shardkit.io.options`); the ranged reader
(:mod:`~shardkit.io.reader`); the local cache (:mod:`~shardkit.io.cache`);
opening and prefetching (:mod:`~shardkit.io.remote`); files with their
compression (:mod:`~shardkit.io.files`).
"""
