"""WebDataset tar shards: samples grouped by key, read with our own header parser.

A tar file is a sequence of 512-byte headers, each followed by its member's
data padded to 512 bytes, ended by two zero blocks. As in WebDataset, the
regular files whose paths share everything up to the first dot of the
basename form one sample, ``{"__key__": key, "__url__": url, ext: bytes, ...}``
(extensions lowercased; ``__*__`` meta members, directories and links are
skipped); a sample is a record. Tars written by ``webdataset.TarWriter``,
``tarfile`` (ustar, GNU and pax formats) and GNU ``tar`` are read, and
:class:`TarWriter` writes ustar tars those read back byte-for-byte.

The package's modules, each importing only those listed after it:
:mod:`~shardkit.formats.tar.format` (:class:`TarFormat`: ranges, counts, the
index), :mod:`~shardkit.formats.tar.writer` (:class:`TarWriter`),
:mod:`~shardkit.formats.tar.parser` (the walk that groups members into samples,
and what it does with damage) and :mod:`~shardkit.formats.tar.headers` (header
checksums, sizes and names, parsed here rather than by ``tarfile``: it says why).
Their underscored names are shared inside the package only.

A bad header costs exactly the sample it belongs to (``framing_intact``
true, so ``on_error="skip"`` skips that sample and counts it). With an index
(``shardkit index``: the byte offset of each sample's first header and the
tar's size, checked when used: size, ascending offsets, a valid header at the
last offset, no index boundary inside a sample) the index says where the next
sample starts; counts need no scan and a range starts with a seek. Without
one the reader *resyncs*: it scans on at 512-byte boundaries for the next
header whose checksum verifies and whose size and type parse, and blames the
damaged run on one sample (:func:`~shardkit.formats.tar.parser._blame`: the one its name names, else the
one around it by the neighbours' keys and extensions); that sample's members
after the run are dropped. Record numbering: the damaged sample keeps its
index and every later sample keeps its own, so a count from an index built
before the damage, a count from a scan after it (which counts the lost
sample, as :meth:`~shardkit.formats.tar.format.TarFormat.scan` does) and the reader agree. Where they
cannot (a run that destroyed several whole samples counts as one, a header
turned to garbage over a pax header may count as one sample more, a tar
stored inside a member can fake a header) the source reports the difference
against the planned count (missing or extra records): never silently. The
retry after a damaged sample seeks to the next one (a :class:`~shardkit.formats.base.ResumeHint`);
gzip-compressed tars are streamed, so their counts and ranges come from a
scan and a retry reads the stream again from its start. A file cut short
loses the rest of the range (``framing_intact`` false): nothing follows. A
member whose size runs past the end of the file is told apart from a cut by
what follows its header: sound headers, or the end-of-archive marker, mean
the size field lies, and it costs its sample like any bad header.
"""

from __future__ import annotations

from shardkit.formats.tar.format import INDEX_MAGIC, TarFormat
from shardkit.formats.tar.writer import TarWriter

__all__ = ["INDEX_MAGIC", "TarFormat", "TarWriter"]
