"""Input resolution (``ingest/read/files.py``): directories, globs and lists; clear errors for what is not there."""

from __future__ import annotations

import os

import pytest

from ingest import SourceError
from ingest.read.files import expand_files


def test_expand_paths_dirs_globs_and_lists(variety_files):
    folder = os.path.dirname(variety_files[0])
    assert expand_files(folder) == variety_files
    assert expand_files(os.path.join(folder, "*.parquet")) == variety_files
    assert expand_files([variety_files[2], variety_files[0]]) == [variety_files[2], variety_files[0]]
    with pytest.raises(SourceError, match="no such file"):
        expand_files(os.path.join(folder, "missing.parquet"))
    with pytest.raises(SourceError, match="more than once"):
        expand_files([variety_files[0], folder])
    with pytest.raises(SourceError, match="glob matched no files"):
        expand_files(os.path.join(folder, "*.nothing"))


def test_hdfs_without_a_cluster_gives_a_clear_error():
    # pyarrow's HadoopFileSystem needs a JVM + libhdfs; without them (or a namenode) the error must name the path.
    with pytest.raises(SourceError) as info:
        expand_files("hdfs://127.0.0.1:1/user/rl/train.parquet")
    assert "hdfs://127.0.0.1:1/user/rl/train.parquet" in str(info.value)
