"""The ``shardkit`` argument parser: one sub-command per job.

Each sub-command is a ``cmd_<name>(args) -> int`` function registered in
:func:`build_parser`; the command modules import their heavy dependencies
inside those functions, so that ``shardkit --help`` stays fast (``demo``,
which needs torch, is imported only when it runs). Argument errors go through
the same one-line format as every other error (:class:`_Parser`), with
argparse's exit code 2.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from shardkit.cli.check import cmd_index, cmd_inspect, cmd_verify
from shardkit.cli.convert import cmd_convert
from shardkit.cli.exits import EXIT_CODES, EXIT_USAGE, one_line
from shardkit.cli.plan import cmd_plan
from shardkit.cli.profile import cmd_profile


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _cmd_demo(args: argparse.Namespace) -> int:
    from shardkit.cli.demo import run_demo

    return run_demo(workdir=args.workdir)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _compression_arg(value: str) -> str | None:
    value = value.lower()
    if value not in ("auto", "none", "gzip", "zlib"):
        raise argparse.ArgumentTypeError(f"expected auto, none, gzip or zlib, not {value!r}")
    return None if value == "none" else value


def _add_compression_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compression",
        default="auto",
        type=_compression_arg,
        help="auto (default: detect from the first bytes), none, gzip or zlib",
    )


def _add_format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        default=None,
        choices=("tfrecord", "tar", "parquet", "jsonl", "megatron"),
        help="read every file in this format (default: detect it by extension, then by the first bytes)",
    )


def _add_urls(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "urls",
        nargs="+" if required else "*",
        metavar="URL",
        help="shard files (TFRecord, WebDataset tar, Parquet, JSON lines; the format is detected by extension, "
        "then magic bytes): paths, fsspec URLs (s3://, gs://, https://...) or quoted globs such as "
        "'data/train-*.tfrecord' or 'data/train-{00000..00127}.tar'",
    )


def _sub(sub: Any, name: str, summary: str, description: str, exits: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=textwrap.fill(f"exit codes: {exits}", 79),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


_MANIFEST_HELP = """\
SOURCE is a manifest, a quoted glob of shard files, or one TFRecord or tar file.

A manifest lists the shards and their record counts: an Arrow IPC, Parquet or
JSON-lines file with a "url" column and optional "num_records" and "size"
columns (relative urls resolve against the manifest's directory; ShardWriter and
to_manifest store local shards that way, so a manifest reads the same from any
working directory). ShardWriter
writes one beside the shards it writes (train-%05d.tfrecord ->
train.manifest.arrow); ShardList(urls, num_records=...).to_manifest(path) writes
one for shards you already have.

A glob (it contains * ? [ or {a,b} / {000..127}) lists the files; their record
counts come from the index files beside them (`shardkit index` writes them).
Without counts only --balance none can be planned: whole shards are dealt out.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardkit`` console script."""
    from shardkit._version import __version__

    parser = _Parser(
        prog="shardkit",
        description="shardkit: plan, inspect, verify, index and convert the shard files of a PyTorch pipeline "
        "(TFRecord, WebDataset tar, Parquet, JSON lines). Also runs as `python -m shardkit`.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    parser.add_argument("--traceback", action="store_true", help="also print the traceback of errors (bug reports)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_plan, _add_inspect, _add_verify, _add_index, _add_convert, _add_profile):
        add(sub)
    return parser


def _add_demo(sub: Any) -> None:
    demo = _sub(
        sub,
        "demo",
        "write a small dataset to a temp dir and show shardkit at work",
        "Write 6 TFRecord shards and a manifest, print the plan for 2 ranks x 2 workers, read them "
        "through DataLoaders and check that every rank gets the same number of batches.",
        "0 the demo's checks passed; 1 a check failed (a bug: please report it); "
        "2 bad arguments, or --workdir cannot be used (a file, not writable)",
    )
    demo.add_argument("--workdir", default=None, help="where to write the data (default: a temp dir)")
    demo.set_defaults(func=_cmd_demo)


def _add_plan(sub: Any) -> None:
    plan_cmd = _sub(
        sub,
        "plan",
        "print who reads what: each rank's and worker's record ranges",
        "Print each rank's and DataLoader worker's record ranges.\n\n" + _MANIFEST_HELP,
        "0 the plan was printed; 2 bad arguments, SOURCE cannot be read (missing, a directory, "
        "malformed, a glob matching nothing), a balanced plan lacks record counts, or --picture cannot be "
        "written. "
        "plan reads no shard data, so it never exits 1.",
    )
    plan_cmd.add_argument(
        "source", metavar="SOURCE", help="a shard manifest, a quoted glob of shard files, or one shard file"
    )
    plan_cmd.add_argument("--world-size", type=_int_at_least(1), default=1, help="number of DDP ranks (default 1)")
    plan_cmd.add_argument(
        "--num-workers", type=_int_at_least(1), default=1, help="DataLoader workers per rank (default 1)"
    )
    plan_cmd.add_argument("--balance", choices=("none", "pad", "drop"), default="pad")
    plan_cmd.add_argument("--seed", type=_int_at_least(0), default=0)
    plan_cmd.add_argument("--epoch", type=_int_at_least(0), default=0)
    plan_cmd.add_argument("--shuffle", action="store_true")
    plan_cmd.add_argument("--show", type=_int_at_least(0), default=3, help="ranges to print per reader (default 3)")
    plan_cmd.add_argument(
        "--picture",
        metavar="OUT.svg",
        help="also draw the plan: which records of each shard each (rank, worker) reads, padding and "
        "dropped records marked (SVG, written atomically; its folder is checked before planning)",
    )
    plan_cmd.set_defaults(func=cmd_plan)


def _add_inspect(sub: Any) -> None:
    inspect_cmd = _sub(
        sub,
        "inspect",
        "record count, sizes and schema of shard files (tar, Parquet, JSON lines, TFRecord)",
        "Read every record (checking CRCs unless --no-verify); print the count, sizes and compression, and "
        "whether the first records are tf.Example or tf.SequenceExample messages, with their features.",
        "0 every file was read; 1 corrupt data found (url, record index, byte offset on stderr); "
        "2 bad arguments, an input cannot be read, or its format is not recognised. Every file is inspected "
        "even after a failure.",
    )
    _add_urls(inspect_cmd)
    inspect_cmd.add_argument(
        "--records", type=_int_at_least(0), default=10, help="records to read the schema from (default 10)"
    )
    inspect_cmd.add_argument("--no-verify", action="store_true", help="skip the CRC checks (faster; says so)")
    _add_compression_option(inspect_cmd)
    _add_format_option(inspect_cmd)
    inspect_cmd.set_defaults(func=cmd_inspect)


def _add_verify(sub: Any) -> None:
    verify_cmd = _sub(
        sub,
        "verify",
        "check every record of shard files (tar, Parquet, JSON lines, TFRecord); exit 1 on corruption",
        "Check every length and data CRC of every file, and that each holds the record count its "
        "manifest (--manifest) or index file gives. Each bad file is reported on its own line with "
        "the record index and byte offset of the damage, and the remaining files are still checked.",
        "0 every file is sound; 1 at least one file is corrupt, or contradicts its manifest or index "
        "file (record count, byte size); 2 bad arguments, an input cannot be read, or its format is not "
        "recognised (2 wins over 1).",
    )
    _add_urls(verify_cmd, required=False)
    verify_cmd.add_argument(
        "--manifest",
        help="also verify every shard this manifest lists, and that each holds the record count "
        "and byte size the manifest gives",
    )
    _add_compression_option(verify_cmd)
    _add_format_option(verify_cmd)
    verify_cmd.set_defaults(func=cmd_verify)


def _add_index(sub: Any) -> None:
    index_cmd = _sub(
        sub,
        "index",
        "write an index file (record byte offsets) beside each shard file (tar, JSON lines, TFRecord)",
        "Write <file>.idx beside each file: the byte offset of every record (length CRCs checked), "
        "written under a temporary name and renamed into place.",
        "0 every index was written; 1 a file is corrupt (no index written for it); 2 bad arguments, an "
        "input cannot be read, or its format is not recognised (2 wins over 1). Every file is indexed even "
        "after a failure.",
    )
    _add_urls(index_cmd)
    _add_compression_option(index_cmd)
    _add_format_option(index_cmd)
    index_cmd.set_defaults(func=cmd_index)


def _add_convert(sub: Any) -> None:
    convert_cmd = _sub(
        sub,
        "convert",
        "rewrite shard files in another format (tfrecord, tar, parquet, jsonl, array_record, lance), with a manifest",
        "Read every record of the files SRC names (a path or a quoted glob; each file's format detected "
        "by extension and magic bytes), in order, and write them into shards DST_PATTERN % 0, % 1, ... "
        "of --format, rolled over by --max-records / --max-bytes, each published by rename, then the "
        "manifest with the record counts. Tar samples keep their keys; rows and lines get their running "
        "number as key. tf.Example features become columns, fields or members (see --decode), and back.",
        "0 converted; 1 a source file is corrupt (url, record index, byte offset on stderr; no manifest "
        "is written); 2 bad arguments, an unreadable source, a source in no known format, a record the "
        "target format cannot hold, or an output that could overwrite a source (SRC a name DST_PATTERN can "
        "produce, or a glob that would pick up the outputs): refused before anything is written; with --ray "
        "also Ray not installed, its cluster not reachable, or DST_PATTERN's names already on storage.",
    )
    convert_cmd.add_argument("source", metavar="SRC", help="a shard file or a quoted glob of them")
    convert_cmd.add_argument(
        "pattern",
        metavar="DST_PATTERN",
        help="output shards, with an integer field: 'out/train-%%05d.tar'; with --format lance, the new dataset's "
        "directory: 'out/train.lance' (written whole, then renamed into place; it must not exist)",
    )
    convert_cmd.add_argument(
        "--format", required=True, choices=("tfrecord", "tar", "parquet", "jsonl", "array_record", "lance")
    )
    convert_cmd.add_argument(
        "--decode",
        choices=("example", "raw"),
        default=None,
        help="example: tf.Example features become Parquet columns, JSON fields or tar members, and are "
        "encoded back into tf.Examples when writing TFRecord; raw: TFRecord records stay opaque bytes "
        "(a 'record' column or member). Default: example when the first TFRecord records are tf.Examples",
    )
    convert_cmd.add_argument("--max-records", type=_int_at_least(1), default=None, help="records per shard at most")
    convert_cmd.add_argument("--max-bytes", type=_int_at_least(1), default=None, help="bytes per shard, about")
    convert_cmd.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="convert on a Ray cluster, one write task per source file (shardkit.ray.write_shards): a local one "
        "without ADDRESS, else ray.init(address=ADDRESS) ('auto', 'host:6379', 'ray://host:10001'). Shards are "
        "named by task and number (train-%%05d.tar -> train-00003-00000.tar); the manifest is the same. Refuses an "
        "output holding such names already. Needs shardkit[ray]",
    )
    convert_cmd.set_defaults(func=cmd_convert)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_profile(sub: Any) -> None:
    profile_cmd = _sub(
        sub,
        "profile",
        "run a pipeline for a while and show where its time goes: stages, workers, the bound, a timeline",
        "Run PIPELINE for --seconds (default 10) or --batches, doing nothing with the batches, and print "
        "samples/s and MB/s, each stage's time summed over the workers, the workers' utilisation, what bounds "
        "the loader (storage, a map, collate, transport, the main process) and what to try. PIPELINE is "
        "module:function (importable from the working directory or PYTHONPATH) returning a MixedLoader or a "
        "dataset, or a quoted glob of shard files read with their format's dataset (balance='none').",
        "0 profiled; 1 corrupt data met while reading; 2 bad arguments, PIPELINE cannot be imported, "
        "called or read (a glob matching nothing), or --trace or --picture cannot be written, or --trace "
        "is a shard file (all found before the run).",
    )
    profile_cmd.add_argument("pipeline", metavar="PIPELINE", help="module:function, or a quoted glob of shards")
    length = profile_cmd.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=_positive_float, default=None, help="run this long (default 10)")
    length.add_argument("--batches", type=_int_at_least(1), default=None, help="run this many batches")
    profile_cmd.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace / Perfetto timeline")
    profile_cmd.add_argument(
        "--picture",
        metavar="OUT.svg",
        help="also draw where the time went: the main loop's wait against compute, each worker's stages "
        "against idle, and the timeline of every stage (SVG; its folder is checked before the run)",
    )
    profile_cmd.add_argument(
        "--batch-size", type=_int_at_least(1), default=64, help="batch size for a dataset (default 64)"
    )
    profile_cmd.add_argument(
        "--num-workers", type=_int_at_least(1), default=2, help="DataLoader workers for a dataset (default 2)"
    )
    profile_cmd.set_defaults(func=cmd_profile)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; a usage error exits 2 with one line naming the sub-command it concerns."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices[args.command]
    if extra:  # argparse would blame the top-level parser: "shardkit: error: ..."
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "verify" and not args.urls and not args.manifest:
        command.error("give URL arguments, --manifest, or both")
    return args
