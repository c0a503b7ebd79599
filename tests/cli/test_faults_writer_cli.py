"""Faults injected for real into ShardWriter runs (SIGKILL, exceptions) and into every CLI sub-command."""

from __future__ import annotations

import glob
import os
import random
import re
import signal
import subprocess
import sys
import time

import fsspec
import pytest

import shardkit
from shardkit.formats.tfrecord import read_tfrecord, verify_tfrecord
from shardkit.shardlist import ShardList
from tests.helpers.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

# A writer process: run "<tag>" writes <count> records of <size> bytes, 10 per shard; it prints
# "paused" and sleeps before record <pause_at> (<count>: after the last, -1: never) and "closed"
# after the with block.
WRITER = """
import sys, time
from shardkit.writer import ShardWriter
pattern, tag, count, size, pause_at = sys.argv[1], sys.argv[2].encode(), *map(int, sys.argv[3:6])
print("started", flush=True)
with ShardWriter(pattern, max_records=10) as writer:
    for i in range(count + 1):
        if i == pause_at:
            print("paused", flush=True)
            time.sleep(600)
        if i < count:
            writer.write(tag + b":%06d:" % i + b"x" * size)
print("closed", flush=True)
time.sleep(600)
"""


def start_writer(pattern: str, tag: str, count: int, *, size: int = 100, pause_at: int = -1) -> subprocess.Popen:
    args = [sys.executable, "-c", WRITER, pattern, tag, str(count), str(size), str(pause_at)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n", proc.stderr.read()
    return proc


def wait_for(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline()
    assert got == line + "\n", f"expected {line!r}, got {got!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def write_run(pattern: str, tag: str, count: int, max_records: int) -> ShardList:
    with shardkit.ShardWriter(pattern, max_records=max_records) as writer:
        for i in range(count):
            writer.write(tag.encode() + b":%06d:" % i + b"x" * 100)
    return writer.shards


def assert_consistent(directory: str) -> str | None:
    """Check what a reader can see after a run was interrupted; return the tag of the
    run the manifest describes, or None when there is no manifest.

    Every file with a final name reads whole with every CRC checked. If there is a
    manifest, every shard it lists holds exactly its count, all from one run, and
    the records numbered 0, 1, 2, ... in shard order.
    """
    for path in glob.glob(os.path.join(directory, "train-*.tfrecord")):
        verify_tfrecord(path)  # raises CorruptRecordError on a partial file
    manifest = os.path.join(directory, "train.manifest.arrow")
    if not os.path.exists(manifest):
        return None
    shards = ShardList.from_manifest(manifest)
    records = []
    for url, count in zip(shards, shards.num_records.tolist()):
        got = list(read_tfrecord(url))
        assert len(got) == count, f"{url} holds {len(got)} records, the manifest says {count}"
        records += got
    tags = {record.split(b":")[0] for record in records}
    assert len(tags) == 1, f"the manifest describes a mix of runs {sorted(tags)}"
    assert [int(record.split(b":")[1]) for record in records] == list(range(len(records)))
    return tags.pop().decode()


def leftovers(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".partial"))


# --------------------------------------------------------------------------- ShardWriter, killed


@pytest.mark.slow
@pytest.mark.parametrize(
    "pause_at, expected",
    [
        (0, "old"),  # killed before the first record: the old run is untouched
        (25, None),  # killed inside the third shard: no manifest at all
        (60, None),  # killed with every record written but not closed
        (-1, "new"),  # killed after close: the new run is complete
    ],
)
def test_killed_writer_never_leaves_a_manifest_describing_a_mix(tmp_path, pause_at, expected):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)  # 5 shards of 7
    proc = start_writer(pattern, "new", 60, pause_at=pause_at)
    wait_for(proc, "paused" if pause_at >= 0 else "closed")
    kill(proc)
    assert assert_consistent(str(tmp_path)) == expected
    partial = leftovers(str(tmp_path))
    assert len(partial) == (1 if pause_at > 0 else 0), partial  # the shard in progress, under a temporary name
    assert all(name.startswith("train-0000") and ".tfrecord." in name for name in partial)


@pytest.mark.slow
def test_writer_killed_at_random_moments_leaves_only_whole_files(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    rng = random.Random(10)
    outcomes = set()
    for attempt in range(6):
        proc = start_writer(pattern, f"run{attempt}", 300, size=20_000)  # 30 shards of 200 kB
        time.sleep(rng.uniform(0, 0.4))
        kill(proc)
        outcomes.add(assert_consistent(str(tmp_path)))
        for name in leftovers(str(tmp_path)):
            os.unlink(tmp_path / name)
    assert None in outcomes  # at least one kill landed mid-run (asserted, so the test exercises it)
    write_run(pattern, "last", 12, max_records=10)
    assert assert_consistent(str(tmp_path)) == "last"


# --------------------------------------------------------------------------- ShardWriter, exceptions


def test_exception_inside_the_with_block_leaves_no_temp_file_and_no_manifest(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    with pytest.raises(RuntimeError, match="boom"):
        with shardkit.ShardWriter(pattern, max_records=10) as writer:
            for i in range(25):
                writer.write(b"new:%06d:" % i)
            raise RuntimeError("boom")
    assert leftovers(str(tmp_path)) == []
    assert not os.path.exists(tmp_path / "train.manifest.arrow")
    assert writer.shards is None
    # the two completed shards are kept, whole; the third (5 records, in progress) is gone
    assert [len(list(read_tfrecord(pattern % i))) for i in range(2)] == [10, 10]
    assert [r.split(b":")[0] for r in read_tfrecord(pattern % 2)] == [b"old"] * 7
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"more")


def test_exception_before_the_first_record_keeps_the_earlier_run(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    with pytest.raises(KeyError):
        with shardkit.ShardWriter(pattern, max_records=10):
            raise KeyError("nothing written yet")
    assert assert_consistent(str(tmp_path)) == "old"


def test_a_new_run_removes_the_old_manifest_before_its_first_shard(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    writer = shardkit.ShardWriter(pattern, max_records=10)
    assert os.path.exists(tmp_path / "train.manifest.arrow")  # constructing the writer changes nothing
    writer.write(b"new:000000:")
    assert not os.path.exists(tmp_path / "train.manifest.arrow")
    assert [r.split(b":")[0] for r in read_tfrecord(pattern % 0)] == [b"old"] * 7  # not replaced until complete
    shards = writer.close()
    assert shards.num_records.tolist() == [1]
    assert assert_consistent(str(tmp_path)) == "new"
    assert leftovers(str(tmp_path)) == []


def test_writer_on_a_remote_filesystem_publishes_by_rename(tmp_path):
    root = f"memory://writer-{os.getpid()}-{random.getrandbits(32)}"
    fs = fsspec.filesystem("memory")
    with pytest.raises(RuntimeError):
        with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=4) as writer:
            for i in range(6):
                writer.write(b"%d" % i)
            raise RuntimeError
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root.split("://")[1], detail=False)) == ["train-000.tfrecord"]
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=4) as writer:
        for i in range(6):
            writer.write(b"%d" % i)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(root.split("://")[1], detail=False))
    assert names == ["train-000.tfrecord", "train-001.tfrecord", "train.manifest.arrow"]
    shards = ShardList.from_manifest(f"{root}/train.manifest.arrow")
    assert [r for url in shards for r in read_tfrecord(url)] == [b"%d" % i for i in range(6)]


# --------------------------------------------------------------------------- the CLI, faults


def write_records(path, count: int, compression: str | None = None) -> str:
    with shardkit.TFRecordWriter(str(path), compression=compression) as writer:
        for i in range(count):
            writer.write(shardkit.encode_example({"i": i, "pad": b"p" * 20}))
    return str(path)


def flip(path, position: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[position] ^= 0x10
    open(path, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """One file or path per fault class, plus good inputs."""
    root = tmp_path_factory.mktemp("cli")
    good = write_records(root / "good.tfrecord", 5)
    record = os.path.getsize(good) // 5
    corrupt = write_records(root / "corrupt.tfrecord", 5)
    flip(corrupt, 2 * record + 14)  # a data byte of record 2: data CRC mismatch
    truncated = write_records(root / "truncated.tfrecord", 5)
    os.truncate(truncated, 3 * record + 7)  # ends inside record 3's header
    manifest = str(root / "good.manifest.arrow")
    ShardList([good], num_records=[5]).to_manifest(manifest)
    cut = str(root / "cut.manifest.arrow")
    open(cut, "wb").write(open(manifest, "rb").read()[:200])
    (root / "garbage.jsonl").write_text("{not json\n")
    (root / "nourl.jsonl").write_text('{"path": "a", "num_records": 1}\n')
    (root / "afile").write_text("a file, not a directory")
    (root / "adir").mkdir()
    indexed = root / "indexed"
    indexed.mkdir()
    write_records(indexed / "a.tfrecord", 3)
    (indexed / "a.tfrecord.idx").write_bytes(b"SKTFIDX1" + b"\x05" + b"\0" * 7)  # a truncated index
    stale = root / "stale"
    stale.mkdir()
    write_records(stale / "a.tfrecord", 3)
    shardkit.build_index(str(stale / "a.tfrecord"))
    write_records(stale / "a.tfrecord", 4)  # rewritten after indexing: the index no longer fits
    return {
        "root": str(root),
        "good": good,
        "corrupt": corrupt,
        "truncated": truncated,
        "manifest": manifest,
        "cut": cut,
        "garbage": str(root / "garbage.jsonl"),
        "nourl": str(root / "nourl.jsonl"),
        "missing": str(root / "missing.tfrecord"),
        "dir": str(root / "adir"),
        "afile": str(root / "afile"),
        "noglob": str(root / "nothing-*.tfrecord"),
        "badindex": str(indexed / "*.tfrecord"),
        "staleindex": str(stale / "*.tfrecord"),
        "staledata": str(stale / "a.tfrecord"),
    }


# (command, fault, argv with {name} placeholders, exit code, a fragment the error line must hold)
FAULTS = [
    ("demo", "workdir is a file", ["--workdir", "{afile}"], 2, "{afile}: exists and is not a directory"),
    ("demo", "workdir under a file", ["--workdir", "{afile}/sub"], 2, "not a directory"),
    ("demo", "unknown option", ["--bogus"], 2, "unrecognized arguments: --bogus"),
    ("plan", "missing manifest", ["{missing}"], 2, "{missing}: no such file"),
    ("plan", "directory", ["{dir}"], 2, "{dir}: is a directory"),
    ("plan", "glob matching nothing", ["{noglob}"], 2, "no files match"),
    ("plan", "malformed manifest", ["{garbage}"], 2, "cannot read manifest"),
    ("plan", "truncated manifest", ["{cut}"], 2, "{cut}"),
    ("plan", "manifest without urls", ["{nourl}"], 2, "{nourl}"),
    (
        "plan",
        "corrupt index file",
        ["{badindex}"],
        2,
        "a.tfrecord: truncated: 16 bytes, shorter than the 24-byte header",
    ),
    ("plan", "stale index file", ["{staleindex}"], 2, "does not fit {staledata}: it describes"),
    ("plan", "bad number", ["{manifest}", "--world-size", "0"], 2, "--world-size: must be >= 1"),
    ("plan", "not a number", ["{manifest}", "--num-workers", "two"], 2, "expected an integer, not 'two'"),
    ("plan", "missing argument", [], 2, "required: SOURCE"),
    ("inspect", "missing file", ["{missing}"], 2, "{missing}: no such file"),
    ("inspect", "directory", ["{dir}"], 2, "{dir}: is a directory"),
    ("inspect", "glob matching nothing", ["{noglob}"], 2, "no files match"),
    ("inspect", "corrupt file", ["{corrupt}"], 1, "{corrupt}: record 2 at byte offset"),
    ("inspect", "truncated file", ["{truncated}"], 1, "{truncated}: record 3 at byte offset"),
    ("inspect", "bad compression", ["{good}", "--compression", "lz4"], 2, "expected auto, none, gzip or zlib"),
    ("verify", "missing file", ["{missing}"], 2, "{missing}: no such file"),
    ("verify", "directory", ["{dir}"], 2, "{dir}: is a directory"),
    ("verify", "glob matching nothing", ["{noglob}"], 2, "no files match"),
    ("verify", "corrupt file", ["{corrupt}"], 1, "{corrupt}: record 2 at byte offset"),
    ("verify", "truncated file", ["{truncated}"], 1, "{truncated}: record 3 at byte offset"),
    ("verify", "no arguments", [], 2, "give URL arguments, --manifest, or both"),
    ("verify", "missing manifest", ["--manifest", "{missing}"], 2, "{missing}: no such file"),
    ("verify", "malformed manifest", ["--manifest", "{garbage}"], 2, "cannot read manifest"),
    ("index", "missing file", ["{missing}"], 2, "{missing}: no such file"),
    ("index", "directory", ["{dir}"], 2, "{dir}: is a directory"),
    ("index", "glob matching nothing", ["{noglob}"], 2, "no files match"),
    ("index", "truncated file", ["{truncated}"], 1, "{truncated}: record 3 at byte offset"),
    ("index", "unknown option", ["{good}", "--fast"], 2, "unrecognized arguments: --fast"),
]


@pytest.mark.slow
@pytest.mark.parametrize("command, fault, argv, code, fragment", FAULTS, ids=[f"{c}-{f}" for c, f, *_ in FAULTS])
def test_every_command_reports_each_fault_as_one_line_and_a_documented_exit_code(
    files, command, fault, argv, code, fragment
):
    done = run_cli(command, *[arg.format(**files) for arg in argv])
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"shardkit {command}: error: "), lines[0]
    assert fragment.format(**files) in lines[0]
    assert done.returncode == code, (done.returncode, lines[0])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
@pytest.mark.parametrize("command", ["plan", "inspect", "verify", "index"])
def test_an_unreadable_file_is_one_line_and_exit_2(tmp_path, command):
    path = write_records(tmp_path / "secret.tfrecord", 3) if command != "plan" else str(tmp_path / "m.arrow")
    if command == "plan":
        ShardList(["a"], num_records=[1]).to_manifest(path)
    os.chmod(path, 0)
    done = run_cli(command, path)
    assert done.stderr.splitlines() == [f"shardkit {command}: error: {path}: permission denied"]
    assert done.returncode == 2


@pytest.mark.slow
def test_help_documents_the_exit_codes_of_every_command():
    top = run_cli("--help")
    assert top.returncode == 0
    for line in ("0    success", "1    corrupt data found", "2    usage error or unreadable input"):
        assert line in top.stdout
    for command in ("demo", "plan", "inspect", "verify", "index"):
        done = run_cli(command, "--help")
        assert done.returncode == 0 and "exit codes: 0 " in done.stdout, command
    assert "ShardWriter" in run_cli("plan", "--help").stdout and "to_manifest" in run_cli("plan", "--help").stdout


# --------------------------------------------------------------------------- the CLI, several files


@pytest.mark.slow
def test_verify_checks_every_file_after_a_failure_and_reports_each_with_its_location(files):
    done = run_cli("verify", files["good"], files["corrupt"], files["truncated"], files["good"])
    assert done.stdout.splitlines() == [f"ok {files['good']}: 5 records"] * 2
    errors = done.stderr.splitlines()
    assert len(errors) == 2
    corrupt = re.escape(files["corrupt"])
    assert re.fullmatch(
        rf"shardkit verify: error: {corrupt}: record 2 at byte offset \d+: data CRC mismatch.*", errors[0]
    )
    assert errors[1].startswith(f"shardkit verify: error: {files['truncated']}: record 3 at byte offset")
    assert done.returncode == 1
    done = run_cli("verify", files["corrupt"], files["missing"], files["good"])
    assert len(done.stderr.splitlines()) == 2 and done.stdout.count("ok ") == 1
    assert done.returncode == 2  # an input that cannot be read wins over corrupt data


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_verify_reports_gzip_damage_on_one_line_with_what_the_error_carries(tmp_path, damage):
    from shardkit.errors import CorruptRecordError

    path = write_records(tmp_path / "a.tfrecord.gz", 400, "gzip")
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        flip(path, os.path.getsize(path) // 2)
    with pytest.raises(shardkit.ShardkitError) as raised:
        verify_tfrecord(path)
    done = run_cli("verify", path)
    assert done.stderr.splitlines() == [f"shardkit verify: error: {raised.value}"]
    assert path in done.stderr
    assert done.returncode == (1 if isinstance(raised.value, CorruptRecordError) else 2)


@pytest.mark.slow
def test_index_is_written_by_rename_and_a_corrupt_file_keeps_its_old_index(tmp_path):
    from shardkit.formats.tfrecord.index import read_index

    good = write_records(tmp_path / "good.tfrecord", 4)
    bad = write_records(tmp_path / "bad.tfrecord", 6)
    assert run_cli("index", bad).returncode == 0
    old_index = open(bad + ".idx", "rb").read()
    os.truncate(bad, os.path.getsize(bad) - 3)
    done = run_cli("index", str(tmp_path / "*.tfrecord"))
    assert done.returncode == 1
    assert done.stdout.splitlines() == [f"{good} -> {good}.idx"]
    assert done.stderr.splitlines()[0].startswith(f"shardkit index: error: {bad}: record 5 at byte offset")
    assert len(read_index(good + ".idx")) == 4
    assert open(bad + ".idx", "rb").read() == old_index
    assert leftovers(str(tmp_path)) == []


# --------------------------------------------------------------------------- inspect, plan


def sequence_example(length: int) -> bytes:
    from tfrecord import example_pb2  # protobuf's own encoder, independent of shardkit's decoder

    message = example_pb2.SequenceExample()
    message.context.feature["length"].int64_list.value.append(length)
    for step in range(length):
        message.feature_lists.feature_list["tokens"].feature.add().int64_list.value.extend([step, step + 1])
        message.feature_lists.feature_list["frames"].feature.add().float_list.value.extend([0.5] * 3)
    return message.SerializeToString()


def test_inspect_recognises_sequence_examples_and_reports_compression_and_crc_checks(tmp_path, capsys):
    from shardkit.cli import main

    path = str(tmp_path / "seq.tfrecord.gz")
    with shardkit.TFRecordWriter(path, compression="gzip") as writer:
        for length in (2, 5, 3):
            writer.write(sequence_example(length))
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}: 3 records, ")
    assert out[0].endswith("; compression: gzip (detected); every length and data CRC checked")
    assert out[2:] == [
        "the first 3 records are tf.SequenceExample messages",
        "  context features:",
        "    length   int64  x 1",
        "  feature lists:",
        "    frames   float  x 3 per step, 2..5 steps",
        "    tokens   int64  x 2 per step, 2..5 steps",
    ]


def test_inspect_tells_examples_from_other_records_and_says_when_crcs_were_skipped(tmp_path, capsys):
    from shardkit.cli import main

    examples = write_records(tmp_path / "ex.tfrecord", 4)
    with shardkit.TFRecordWriter(str(tmp_path / "raw.tfrecord")) as writer:
        writer.write(b"\xff\xff\xff")  # field 31 with wire type 7: not a protobuf message
    assert main(["inspect", "--records", "2", examples, str(tmp_path / "raw.tfrecord")]) == 0
    out = capsys.readouterr().out
    assert "the first 2 records are tf.Example messages; features:\n  i        int64  x 1\n  pad      bytes  x 1" in out
    assert "the first 1 records are neither tf.Example nor tf.SequenceExample messages" in out
    flip(examples, os.path.getsize(examples) // 4 + 14)  # a data byte of record 1
    assert main(["inspect", examples]) == 1
    assert re.search(r"record 1 at byte offset \d+: data CRC mismatch", capsys.readouterr().err)
    assert main(["inspect", "--no-verify", examples]) == 0
    assert "compression: none (detected); CRCs NOT checked (--no-verify)" in capsys.readouterr().out


def test_plan_takes_a_glob_with_counts_from_index_files(tmp_path, capsys):
    from shardkit.cli import main
    from shardkit.formats.tfrecord.index import build_index

    paths = [write_records(tmp_path / f"train-{i}.tfrecord", n) for i, n in enumerate((3, 8, 5))]
    glob_arg = str(tmp_path / "train-*.tfrecord")
    assert main(["plan", glob_arg, "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit plan: error: balance='pad' needs the record count") and err.count("\n") == 1
    assert main(["plan", glob_arg, "--world-size", "2", "--balance", "none"]) == 0
    assert "record counts: unknown (no index files; write them with `shardkit index`)" in capsys.readouterr().out
    for path in paths:
        build_index(path)
    assert main(["plan", glob_arg, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "record counts: from index files (3 of 3 shards)" in out
    assert "3 shards, 16 records" in out and "records per rank: 8, 8" in out


@pytest.mark.slow
def test_verify_with_a_manifest_catches_a_shard_replaced_or_miscounted(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    shards = write_run(pattern, "run", 25, max_records=10)
    assert shards.sizes.tolist() == [os.path.getsize(pattern % i) for i in range(3)]
    manifest = str(tmp_path / "train.manifest.arrow")
    done = run_cli("verify", "--manifest", manifest)
    assert done.returncode == 0 and done.stdout.count("(count matches the manifest)") == 3, done.stderr
    with shardkit.TFRecordWriter(pattern % 1) as writer:  # same count, other bytes: a replaced file
        for i in range(10):
            writer.write(b"other:%06d:" % i)
    ShardList([pattern % 0], num_records=[9]).to_manifest(str(tmp_path / "miscounted.arrow"))
    done = run_cli("verify", "--manifest", manifest)
    assert done.returncode == 1
    size = os.path.getsize(pattern % 1)
    line = f"shardkit verify: error: {pattern % 1}: {size} bytes, but the manifest {manifest} says"
    assert done.stderr.startswith(line) and done.stderr.count("\n") == 1
    miscounted = str(tmp_path / "miscounted.arrow")
    done = run_cli("verify", "--manifest", miscounted)
    assert done.stderr == f"shardkit verify: error: {pattern % 0}: 10 records, but the manifest {miscounted} says 9\n"
    assert done.returncode == 1


def test_writer_on_s3_replaces_an_earlier_run_by_copy_and_leaves_nothing_after_an_exception(s3_server):
    options = s3_server.storage_options()
    root = s3_server.new_bucket()
    fs = fsspec.filesystem("s3", **options)
    pattern = f"{root}/train-%03d.tfrecord"
    with shardkit.ShardWriter(pattern, max_records=4, storage_options=options) as writer:
        for i in range(10):
            writer.write(b"old:%d" % i)
    with pytest.raises(RuntimeError):
        with shardkit.ShardWriter(pattern, max_records=4, storage_options=options) as writer:
            for i in range(6):
                writer.write(b"new:%d" % i)
            raise RuntimeError
    names = sorted(path.rsplit("/", 1)[1] for path in fs.ls(root, detail=False))
    assert names == ["train-000.tfrecord", "train-001.tfrecord", "train-002.tfrecord"]  # no manifest, no .partial
    assert list(read_tfrecord(pattern % 0, storage_options=options)) == [b"new:%d" % i for i in range(4)]
    assert list(read_tfrecord(pattern % 1, storage_options=options)) == [b"old:%d" % i for i in range(4, 8)]
    with shardkit.ShardWriter(pattern, max_records=4, storage_options=options) as writer:
        for i in range(5):
            writer.write(b"last:%d" % i)
    shards = ShardList.from_manifest(f"{root}/train.manifest.arrow", storage_options=options)
    assert shards.num_records.tolist() == [4, 1]
    assert shards.sizes.tolist() == [fs.size(url) for url in shards]
