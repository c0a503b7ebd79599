"""Small things a new user meets in the first hour: warnings, wording, progress bars, examples."""

from __future__ import annotations

import gc
import warnings

import shardkit
from shardkit.stats import SharedStats


def resource_warnings(make) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = make()
        del made
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def test_shared_stats_close_their_lock_file_without_a_resource_warning():
    assert resource_warnings(lambda: SharedStats(3)) == []


def test_a_dataset_leaves_no_unclosed_file_behind(tmp_path):
    with shardkit.TFRecordWriter(str(tmp_path / "a.tfrecord")) as w:
        w.write(shardkit.encode_example({"x": 1}))
    url = str(tmp_path / "a.tfrecord")
    assert resource_warnings(lambda: list(shardkit.TFRecordDataset(url))) == []
    assert resource_warnings(lambda: shardkit.TFRecordDataset(url)) == []
