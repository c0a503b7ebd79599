"""The command line's refusals, each injected for real: an output that can overwrite an input (convert,
profile --trace), a trace that cannot be written, a file in no known format or not the one its name says,
an index file or an unreadable shard given to plan; and the paths results print, as the user typed them.

Each refusal is one line on stderr, no traceback, exit 2, and nothing written."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.formats.tfrecord import read_tfrecord
from tests.helpers.cli import run_cli
from tests.helpers.examples import examples


def write_shards(folder: Path, counts: list[int], name: str = "part") -> list[str]:
    """TFRecord shards ``folder/name-00000.tfrecord``... holding b"rec0", b"rec1", ... in order."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    urls = []
    for shard, count in enumerate(counts):
        url = str(folder / f"{name}-{shard:05d}.tfrecord")
        with shardkit.TFRecordWriter(url) as out:
            for n in range(start, start + count):
                out.write(b"rec%d" % n)
        start += count
        urls.append(url)
    return urls


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes: what must not change."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def one_error_line(done: subprocess.CompletedProcess, command: str) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"shardkit {command}: error: ")
    return lines[0]


# --------------------------------------------------------------------------- convert: outputs over inputs


def test_convert_refuses_an_output_pattern_that_names_its_own_source_shards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [5, 5])
    before = snapshot(tmp_path)
    done = run_cli("convert", "d/part-*.tfrecord", "d/part-%05d.tfrecord", "--format", "tfrecord", "--max-records", "3")
    line = one_error_line(done, "convert")
    assert "would write over the input d/part-00000.tfrecord" in line
    assert done.returncode == 2
    assert done.stdout == ""
    assert snapshot(tmp_path) == before  # nothing written, nothing replaced
    assert [r for url in sorted((tmp_path / "d").glob("*")) for r in read_tfrecord(str(url))] == [
        b"rec%d" % n for n in range(10)
    ]


def test_convert_refuses_a_source_glob_that_would_read_its_outputs_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [5, 5])
    before = snapshot(tmp_path)
    done = run_cli("convert", "d/*.tfrecord", "d/out-%05d.tfrecord", "--format", "tfrecord")
    line = one_error_line(done, "convert")
    assert "the source glob 'd/*.tfrecord' matches the output" in line and "out-00000.tfrecord" in line
    assert done.returncode == 2
    assert snapshot(tmp_path) == before


def test_convert_refuses_an_input_reached_through_a_symlinked_folder_or_dot_dot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [4])
    (tmp_path / "link").symlink_to(tmp_path / "d")
    before = snapshot(tmp_path / "d")
    for source, pattern in [
        ("link/part-00000.tfrecord", "d/part-%05d.tfrecord"),
        ("d/part-00000.tfrecord", "link/part-%05d.tfrecord"),
        ("d/part-00000.tfrecord", "d/sub/../part-%05d.tfrecord"),
        ("./d/part-00000.tfrecord", "d/part-%05d.tfrecord"),
    ]:
        done = run_cli("convert", source, pattern, "--format", "tfrecord")
        assert "would write over the input" in one_error_line(done, "convert"), (source, pattern)
        assert done.returncode == 2
    assert snapshot(tmp_path / "d") == before


def test_convert_refuses_a_source_that_is_the_output_manifest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [4])
    os.replace(tmp_path / "d" / "part-00000.tfrecord", tmp_path / "d" / "out.manifest.arrow")
    before = snapshot(tmp_path)
    done = run_cli("convert", "d/out.manifest.arrow", "d/out-%05d.parquet", "--format", "parquet")
    assert "would write over the input d/out.manifest.arrow" in one_error_line(done, "convert")
    assert done.returncode == 2
    assert snapshot(tmp_path) == before


def test_convert_to_names_no_input_can_take_still_converts_every_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [5, 5])
    done = run_cli("convert", "d/part-*.tfrecord", "d/all-%d.tfrecord", "--format", "tfrecord", "--max-records", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "10 records from 2 files -> 4 tfrecord shards; manifest d/all.manifest.arrow"
    assert [r for n in range(4) for r in read_tfrecord(f"d/all-{n}.tfrecord")] == [b"rec%d" % n for n in range(10)]


# --------------------------------------------------------------------------- profile --trace


def test_profile_refuses_a_trace_path_that_is_one_of_its_input_shards_before_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [8, 8])
    before = snapshot(tmp_path)
    done = run_cli("profile", "d/part-*.tfrecord", "--batches", "1", "--trace", "d/part-00001.tfrecord")
    line = one_error_line(done, "profile")
    assert "--trace d/part-00001.tfrecord is a shard file" in line
    assert done.returncode == 2
    assert done.stdout == ""  # refused before the run: no report
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "trace, reason", [("nodir/t.json", "no such file or directory"), ("afile/t.json", "not a directory")]
)
def test_profile_finds_an_unwritable_trace_path_before_the_run(tmp_path, monkeypatch, trace, reason):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [8])
    (tmp_path / "afile").write_text("a file, not a folder")
    done = run_cli("profile", "d/part-*.tfrecord", "--batches", "1", "--trace", trace)
    line = one_error_line(done, "profile")
    assert line.startswith(f"shardkit profile: error: cannot write the trace to {trace}: ") and reason in line
    assert done.returncode == 2
    assert done.stdout == ""


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("command", ["verify", "inspect", "index", "plan"])
def test_a_file_in_no_known_format_is_format_not_recognised_with_exit_2(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    Path("notes.dat").write_text("hello world, this is text and no shard format at all\n")
    done = run_cli(command, "notes.dat")
    line = one_error_line(done, command)
    assert line.startswith(f"shardkit {command}: error: notes.dat: format not recognised: ")
    assert "CRC" not in line
    assert done.returncode == 2
    assert sorted(os.listdir()) == ["notes.dat"]  # index wrote nothing


@pytest.mark.parametrize("command", ["verify", "inspect", "index"])
def test_a_parquet_file_named_tfrecord_names_the_format_option_and_that_option_reads_it(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    with shardkit.ShardWriter("p/x-%05d.parquet") as writer:
        for n in range(6):
            writer.write({"n": n})
    os.replace("p/x-00000.parquet", "fake.tfrecord")
    done = run_cli(command, "fake.tfrecord")
    line = one_error_line(done, command)
    assert line == (
        f"shardkit {command}: error: fake.tfrecord: its name says TFRecord, but this is a Parquet file; "
        "read it with --format parquet"
    )
    assert done.returncode == 2
    fixed = run_cli(command, "fake.tfrecord", "--format", "parquet")
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.startswith("ok fake.tfrecord: 6 records" if command == "verify" else "fake.tfrecord")


def test_plan_on_an_index_file_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "d", [5])
    assert run_cli("index", "d/part-00000.tfrecord").returncode == 0
    done = run_cli("plan", "d/part-00000.tfrecord.idx")
    line = one_error_line(done, "plan")
    assert line.startswith("shardkit plan: error: d/part-00000.tfrecord.idx: a shardkit index file; ")
    assert "manifest" in line and "JSON" not in line
    assert done.returncode == 2


def test_plan_skips_the_index_and_manifest_files_a_glob_picks_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with shardkit.ShardWriter("d/part-%05d.tfrecord", max_records=5) as writer:
        for n in range(10):
            writer.write(b"rec%d" % n)
    assert run_cli("index", "d/part-00000.tfrecord", "d/part-00001.tfrecord").returncode == 0
    done = run_cli("plan", "d/*")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:3] == [
        "skipped d/part-00000.tfrecord.idx: a shardkit index file; read the data file it indexes "
        "(the same name without .idx)",
        "skipped d/part-00001.tfrecord.idx: a shardkit index file; read the data file it indexes "
        "(the same name without .idx)",
        "skipped d/part.manifest.arrow: a shard manifest",
    ]
    assert "2 shards, 10 records" in done.stdout


def test_plan_on_an_unreadable_shard_says_so_in_one_line():
    as_user = []
    if os.geteuid() == 0:  # root reads any file: run as nobody, for whom the mode holds
        if shutil.which("setpriv") is None:
            pytest.skip("root reads files whatever their mode, and setpriv is missing to run as nobody")
        as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    folder = Path(tempfile.mkdtemp(prefix="shardkit-unreadable-"))  # under /tmp, which nobody may enter
    try:
        folder.chmod(0o755)
        write_shards(folder, [3], name="shard")
        os.replace(folder / "shard-00000.tfrecord", folder / "shard-0")  # no suffix: only its bytes tell
        os.chmod(folder / "shard-0", 0)
        code = "import sys; from shardkit.cli import main; sys.exit(main(['plan', 'shard-0']))"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        command = [*as_user, sys.executable, "-c", code]
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(folder)
    assert done.stderr.splitlines() == ["shardkit plan: error: shard-0: permission denied"]
    assert done.returncode == 2


# --------------------------------------------------------------------------- paths as typed


@pytest.fixture
def two_folders(tmp_path, monkeypatch) -> Path:
    """Shards in tmp/data (indexed), the working directory tmp/work."""
    write_shards(tmp_path / "data", [3, 2], name="train")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


@pytest.mark.parametrize(
    "typed, shown",
    [
        ("../data/*.tfrecord", "../data/train-00000.tfrecord"),
        ("./../work/../data/train-0000[0-1].tfrecord", "../data/train-00000.tfrecord"),
        ("../data/train-00000.tfrecord", "../data/train-00000.tfrecord"),
        ("{root}/work/../data/*.tfrecord", "{root}/data/train-00000.tfrecord"),
        ("file://{root}/data/*.tfrecord", "file://{root}/data/train-00000.tfrecord"),
    ],
)
def test_verify_inspect_and_index_print_paths_as_the_user_typed_them(two_folders, typed, shown):
    typed, shown = typed.format(root=two_folders), shown.format(root=two_folders)
    verified = run_cli("verify", typed)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.splitlines()[0] == f"ok {shown}: 3 records"
    inspected = run_cli("inspect", typed)
    assert inspected.stdout.splitlines()[0].startswith(f"{shown}: 3 records")
    indexed = run_cli("index", typed)
    assert indexed.stdout.splitlines()[0] == f"{shown} -> {shown}.idx"


def test_plan_prints_shards_as_the_user_typed_the_source(two_folders):
    relative = run_cli("plan", "../data/*.tfrecord", "--balance", "none")
    assert "../data/train-00000.tfrecord[0:], ../data/train-00001.tfrecord[0:]" in relative.stdout
    absolute = run_cli("plan", f"{two_folders}/data/../data/*.tfrecord", "--balance", "none")
    assert f"{two_folders}/data/train-00000.tfrecord[0:]" in absolute.stdout


def test_an_error_names_the_file_as_the_user_typed_it(two_folders):
    os.symlink(two_folders / "missing.tfrecord", two_folders / "data" / "train-00009.tfrecord")
    done = run_cli("verify", "../data/*.tfrecord")
    assert done.stderr.splitlines() == [
        "shardkit verify: error: ../data/train-00009.tfrecord: no such file or directory"
    ]
    assert done.returncode == 2


# --------------------------------------------------------------------------- which names a pattern can produce


@settings(max_examples=examples(300), deadline=None)
@given(
    base=st.sampled_from(["part-%05d.tfrecord", "part-%d.tfrecord", "%03d.tar", "x_%2d.parquet", "p-%05d.bin"]),
    n=st.integers(0, 10**15),
)
def test_a_name_is_an_output_exactly_when_the_pattern_formats_some_number_to_it(base, n):
    from shardkit.cli.outputs import _produces

    made = base % n
    assert _produces(base, made)
    if base.endswith(".bin"):
        assert _produces(base, made[: -len(".bin")] + ".idx")  # a Megatron pair's index
    field = re.search(r"%\d*d", base)
    assert field is not None
    prefix, suffix = base[: field.start()], base[field.end() :]
    digits = made[len(prefix) : len(made) - len(suffix)]
    assert not _produces(base, f"{prefix}0{digits}{suffix}")  # the same number, spelled with one more 0
    assert not _produces(base, f"y{made}")
    assert not _produces(base, f"{made}.gz")


def test_convert_of_a_folder_glob_skips_its_index_and_manifest_files_and_converts_every_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with shardkit.ShardWriter("d/part-%05d.tfrecord", max_records=5) as writer:
        for n in range(10):
            writer.write(b"rec%d" % n)
    assert run_cli("index", "d/part-00000.tfrecord").returncode == 0
    done = run_cli("convert", "d/*", "out/all-%d.tfrecord", "--format", "tfrecord")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "skipped d/part-00000.tfrecord.idx: a shardkit index file; read the data file it indexes "
        "(the same name without .idx)",
        "skipped d/part.manifest.arrow: a shard manifest",
        "10 records from 2 files -> 1 tfrecord shards; manifest out/all.manifest.arrow",
    ]
    assert list(read_tfrecord("out/all-0.tfrecord")) == [b"rec%d" % n for n in range(10)]


def test_convert_of_a_glob_of_only_index_and_manifest_files_is_one_line_with_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with shardkit.ShardWriter("d/part-%05d.tfrecord", max_records=5) as writer:
        writer.write(b"rec")
    done = run_cli("convert", "d/*.arrow", "out/all-%d.tfrecord", "--format", "tfrecord")
    assert "d/*.arrow: matches only index and manifest files; give the shards" in one_error_line(done, "convert")
    assert done.returncode == 2
    assert not (tmp_path / "out").exists()
