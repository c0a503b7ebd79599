"""Record counts for shard lists that lack them.

Sources resolve the counts they plan with in one function, :func:`plan_counts`,
the same way in every rank and DataLoader worker whichever of ``len()``,
``state_dict()``, ``count_records()`` or iteration runs first, so that the plan
is a function of the shards, their counts as the job sees them, the topology,
the seed and the epoch. In order of preference the counts come from:

1. the :class:`~shardkit.ShardList` itself (a manifest, ``num_records=``, or
   an earlier ``count_records()``, which every rank calls: it is collective
   under a process group);
2. the counts stored with every shard (:func:`counts_from_indexes`): a
   checked index file beside it (``shardkit index``), a Parquet footer. They
   are looked up under every balance mode, ``"none"`` included, since they are
   a function of the files: every reader finds the same ones. An index that
   does not fit its shard raises :class:`~shardkit.formats.offsets.IndexFileError`
   rather than being trusted;
3. only when the plan cannot go without counts (``"pad"``/``"drop"`` over
   several ranks, sample-level shuffling; :func:`resolve_counts`): the counts
   cache of an earlier counting pass, for every shard whose file still has the
   identity it had when it was counted (:func:`~shardkit.io.identity.identity`: size plus
   modification time, inode, ETag, version or generation — whatever the
   filesystem reports), then ``count_fn(url)`` for the others only — for
   TFRecord, the index file when there is a valid one, else a fast framing
   scan. When ``torch.distributed`` is initialised the shards are shared out
   over the ranks and the counts all-gathered. Under ``on_error="skip"`` a
   shard that breaks while counted counts as what reading it yields
   (:func:`readable_count`), and that count is not cached;
4. else the counts stay unknown, and plans deal whole shards.

The cache never turns unknown counts into known ones: it is per machine and
fills as ranks count, so a rank on a machine that counted in an earlier run
would split records while ranks elsewhere dealt whole shards. Its rows say
whether a count was taken from an index or footer (``stored``); such a row,
for a file that kept its identity, stands in for reading that index again.

Once per job: under an initialised process group, the first rank to build a
dataset over a shard list looks the stored counts up (step 2) as it builds it
and puts its answer (the counts, or that there are none) in the group's store;
the other ranks take that answer (:func:`shared_stored_counts`, no collective,
as :mod:`shardkit.listing` shares a listing), and DataLoader workers receive it
with the dataset: they look nothing up. So an index file written (or removed)
while a job starts cannot give ranks different plans: the first rank's answer
holds for the whole job. Without a process group (ranks given as ``rank=``,
``world_size=``) each reader looks the files up when it first plans, and a
reader that saw every index would split records while one that found a shard
without its index dealt whole shards: write indexes (or a manifest) before the
job starts.

Where the cache lives (never beside the data: shardkit writes nothing where
the user did not ask): one Arrow IPC file per shard list, named by the hash of
its urls (:meth:`ShardList.url_digest`), in :func:`cache_dir` — the
``cache_dir`` argument, else ``$SHARDKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/shardkit``, else ``~/.cache/shardkit``. An empty
``SHARDKIT_CACHE_DIR`` turns the cache off. Each row holds a url, its count
and the identity its file had *before* it was counted, so a file rewritten
during the count is counted again next time. The file is written to a
temporary name and renamed; one that cannot be read (truncated, corrupt, of
another list) is ignored and rewritten. To share counts between machines,
write a manifest (:meth:`ShardList.to_manifest`) instead.

The package, bottom up: :mod:`~shardkit.counting.scan` (counting by a scan,
shared over ranks), :mod:`~shardkit.counting.cache` (the counts cache),
:mod:`~shardkit.counting.resolve` (which counts a plan uses); the names sources
use are importable from here.
"""

from shardkit.counting.cache import CACHE_ENV, cache_dir, cache_path
from shardkit.counting.resolve import (
    CountsUnavailableError,
    counts_from_indexes,
    plan_counts,
    resolve_counts,
    shared_stored_counts,
)
from shardkit.counting.scan import CountFn, OnError, ReadFn, Salvage, StoredCountFn, readable_count

__all__ = [
    "CACHE_ENV",
    "CountFn",
    "CountsUnavailableError",
    "OnError",
    "ReadFn",
    "Salvage",
    "StoredCountFn",
    "cache_dir",
    "cache_path",
    "counts_from_indexes",
    "plan_counts",
    "readable_count",
    "resolve_counts",
    "shared_stored_counts",
]
