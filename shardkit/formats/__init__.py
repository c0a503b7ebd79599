"""Shard file formats: how each kind of shard file is counted, read, indexed and written.

Layered, each layer importing only those below it (import-linter checks it):

- :mod:`~shardkit.formats.registry`: finds the format of a file by its name or first bytes;
- the formats: :mod:`~shardkit.formats.tfrecord`, :mod:`~shardkit.formats.tar`,
  :mod:`~shardkit.formats.jsonl`, :mod:`~shardkit.formats.parquet`,
  :mod:`~shardkit.formats.megatron` (Megatron-LM ``.bin``/``.idx`` pairs),
  :mod:`~shardkit.formats.litdata` (LitData chunks), :mod:`~shardkit.formats.lance` (Lance fragments), and
  :mod:`~shardkit.formats.example_rows` (tf.Example records as rows and back);
- what they share: :mod:`~shardkit.formats.base` (the :class:`~shardkit.formats.base.ShardFormat`
  interface and its defaults), :mod:`~shardkit.formats.offsets` (the index file container)
  and :mod:`~shardkit.formats.example` (tf.Example coding);
- :mod:`~shardkit.formats.crc` and :mod:`~shardkit.formats.sniff`.

Nothing is imported here, so that importing one format does not import the others.
"""
