"""Credentials in urls (``user:password@``, presigned query strings) never reach a message: errors (also
re-raised from DataLoader workers), skip warnings, CLI lines and tar samples' ``__url__`` show ``***``
instead, while reading still uses the real url."""

from __future__ import annotations

import logging
import os
import traceback
import warnings
from collections.abc import Iterator

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit.counting import resolve_counts
from shardkit.errors import ShardkitError, redact, redact_url, reraise_redacted
from shardkit.formats.tfrecord import read_tfrecord
from shardkit.listing import shared_listing
from shardkit.shardlist import ShardList
from tests.helpers.fault_server import FaultServer
from tests.helpers.reading import shut_down_workers
from tests.helpers.shards import record_offsets
from tests.io.test_remote_reads import write_shard
from tests.sources.test_faults_reading import flip_data_byte

SECRETS = ("s3cr3tpw", "SIGabc", "CREDdef", "TOKghi", "STSjkl", "user:")
QUERY = "?X-Amz-Signature=SIGabc&X-Amz-Credential=CREDdef&X-Amz-Security-Token=STSjkl&token=TOKghi"


def assert_clean(text: str) -> None:
    assert text, "no message at all"
    leaked = [secret for secret in SECRETS if secret in text]
    assert not leaked, f"{leaked} in {text!r}"
    assert "***" in text, text


def full_text(error: BaseException) -> str:
    """Everything a printed traceback shows of ``error``, its causes and contexts included."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


@pytest.fixture
def server(tmp_path) -> Iterator[FaultServer]:
    with FaultServer(str(tmp_path)) as running:
        yield running


def secret_url(server: FaultServer, name: str) -> str:
    return f"{server.url.replace('http://', 'http://user:s3cr3tpw@')}/{name}{QUERY}"


def corrupt_shard(server: FaultServer, tmp_path, name: str = "bad.tfrecord") -> str:
    write_shard(str(tmp_path / name), count=10)
    flip_data_byte(str(tmp_path / name), record_offsets(str(tmp_path / name)), [3])
    return secret_url(server, name)


def test_redact_url_hides_userinfo_and_every_query_value_and_keeps_the_rest() -> None:
    url = "https://me:pw@host.example:8443/b/k.tar?X-Amz-Signature=abc&X-Amz-Credential=a%2Fb&sig=1&v"
    assert redact_url(url) == "https://***@host.example:8443/b/k.tar?X-Amz-Signature=***&X-Amz-Credential=***&sig=***&v"
    assert redact_url("s3://bucket/key.tfrecord") == "s3://bucket/key.tfrecord"
    assert redact_url(redact_url(url)) == redact_url(url)


def test_redact_finds_urls_inside_text_and_keeps_the_punctuation_after_them() -> None:
    text = "http://u:p@h/a?token=t1: record 3; see 'https://h/b?sig=s2', (gs://b/c?x=1)."
    assert redact(text) == "http://***@h/a?token=***: record 3; see 'https://h/b?sig=***', (gs://b/c?x=***)."


LEAKY_URL = "https://h/k?X-Amz-Signature=SIGabc&token=TOKghi"
MISSING_URL = "http://user:s3cr3tpw@h/k?token=TOKghi"


class Leaky(Exception):
    """An error whose text is built from an attribute, as aiohttp's ClientResponseError's is."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def __str__(self) -> str:
        return f"403, message='Forbidden', url={self.url!r}"


def test_an_error_whose_text_cannot_be_cleaned_is_replaced_and_a_cause_that_cannot_is_cut_off() -> None:
    leaky = Leaky(LEAKY_URL)  # names, not literals: a traceback shows the source lines
    with pytest.raises(ShardkitError) as info:
        try:
            raise leaky
        except Leaky as error:
            reraise_redacted(error)
    assert_clean(full_text(info.value))
    with pytest.raises(FileNotFoundError) as caught:
        try:
            try:
                raise leaky
            except Leaky as error:
                raise FileNotFoundError(MISSING_URL) from error
        except FileNotFoundError as error:
            reraise_redacted(error)
    assert_clean(full_text(caught.value))
    assert str(caught.value) == "http://***@h/k?token=***"


def test_a_missing_object_error_names_the_url_without_its_credentials(server, tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        list(read_tfrecord(secret_url(server, "missing.tfrecord")))
    assert_clean(full_text(info.value))
    assert any("X-Amz-Signature=SIGabc" in request.path for request in server.log)  # read with the real url


def test_a_corrupt_record_error_names_the_url_without_its_credentials(server, tmp_path) -> None:
    url = corrupt_shard(server, tmp_path)
    with pytest.raises(shardkit.CorruptRecordError) as info:
        list(read_tfrecord(url))
    assert_clean(full_text(info.value))
    assert info.value.url == url  # the attribute is the url read, for code that reads it again


def test_a_skip_warning_names_the_url_without_its_credentials(server, tmp_path) -> None:
    url = corrupt_shard(server, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (
            len(list(shardkit.TFRecordDataset([url], on_error="skip", balance="none", index=False, decode="raw"))) == 9
        )
    skips = [str(w.message) for w in caught if "skipping" in str(w.message)]
    assert skips
    for text in skips:
        assert_clean(text)


def test_an_error_re_raised_from_a_dataloader_worker_names_the_url_without_its_credentials(server, tmp_path) -> None:
    corrupt = corrupt_shard(server, tmp_path)
    missing = secret_url(server, "missing.tfrecord")
    for shards, error in (([corrupt], shardkit.CorruptRecordError), (shardkit.ShardList([missing], [5]), Exception)):
        loader = DataLoader(
            shardkit.TFRecordDataset(shards, balance="none", index=False, decode="raw"), batch_size=None, num_workers=1
        )
        with pytest.raises(error) as info:
            list(loader)
        shut_down_workers(info.value.__traceback__)  # now: left to the cycle collector, 5 s for the worker
        assert "DataLoader worker" in str(info.value)
        assert_clean(full_text(info.value))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_cli_errors_name_the_url_without_its_credentials(server, tmp_path, command) -> None:
    from tests.helpers.cli import run_cli

    for url in (corrupt_shard(server, tmp_path), secret_url(server, "missing.tfrecord")):
        done = run_cli(command, url)
        assert done.returncode != 0 and "error" in done.stderr, done.stderr
        assert_clean(done.stderr)
        for secret in SECRETS:
            assert secret not in done.stdout


def test_tar_samples_carry_their_url_without_its_credentials(server, tmp_path) -> None:
    from tests.helpers.shards import write_tar_shards

    (path,) = write_tar_shards(str(tmp_path), [3])
    url = secret_url(server, os.path.basename(path))
    samples = list(shardkit.TarDataset([url], balance="none", index=False))
    assert len(samples) == 3
    for sample in samples:
        assert_clean(sample["__url__"])


class LeakyFileSystem(fsspec.AbstractFileSystem):
    """A store whose errors name the url they failed on, credentials and all (as some clients' do)."""

    protocol = "leaky"

    def glob(self, path, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(f"403 Forbidden listing leaky://{path}")

    def ls(self, path, detail=True, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(f"403 Forbidden listing leaky://{path}")


def leaky_url(path: str) -> str:
    """A url of the leaky store, made here so that no traceback line of a test shows its secrets."""
    fsspec.register_implementation("leaky", LeakyFileSystem, clobber=True)
    return f"leaky://user:s3cr3tpw@host/{path}{QUERY}"


def test_a_listing_that_fails_in_the_store_names_the_url_without_its_credentials() -> None:
    pattern = leaky_url("d/*.tfrecord")
    with pytest.raises(PermissionError) as caught:
        shared_listing(pattern)
    assert_clean(full_text(caught.value))


def test_counting_logs_name_the_url_without_its_credentials(server, tmp_path, caplog) -> None:
    urls = [secret_url(server, "absent/a.tfrecord"), leaky_url("d/b.tfrecord")]
    with caplog.at_level(logging.DEBUG, logger="shardkit"):
        counted = resolve_counts(ShardList(urls), lambda url: 1, why="a test", cache_dir=str(tmp_path / "cache"))
    assert counted.total_records == 2
    listed = [record.getMessage() for record in caplog.records if "cannot list" in record.getMessage()]
    assert len(listed) == 2, [record.getMessage() for record in caplog.records]
    for message in listed:
        assert_clean(message)
