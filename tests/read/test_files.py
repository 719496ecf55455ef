"""Input resolution (``ingest/read/files.py``): directories, globs and lists; clear errors for what is not there."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest import SourceError
from ingest.read.files import expand_files, reads_as_pil_images


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


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
LIST_OF_IMAGES = {"feature": {"_type": "Image"}, "_type": "List"}


@pytest.mark.parametrize(
    "feature,column_type,decoded",
    [
        (LIST_OF_IMAGES, pa.list_(IMAGE_STRUCT), True),
        ({"feature": {"_type": "Image"}, "_type": "Sequence"}, pa.list_(IMAGE_STRUCT), True),
        ([{"_type": "Image"}], pa.list_(IMAGE_STRUCT), True),
        ({"feature": {"_type": "Image"}, "_type": "LargeList"}, pa.large_list(IMAGE_STRUCT), True),
        (None, pa.list_(IMAGE_STRUCT), False),  # no metadata
        ({"feature": {"_type": "Image", "decode": False}, "_type": "List"}, pa.list_(IMAGE_STRUCT), False),
        # HF datasets ignores a feature whose Arrow type is not the column's: fields reordered, large_binary bytes
        (LIST_OF_IMAGES, pa.list_(pa.struct([("path", pa.string()), ("bytes", pa.binary())])), False),
        (LIST_OF_IMAGES, pa.list_(pa.struct([("bytes", pa.large_binary()), ("path", pa.string())])), False),
        ({"feature": {"dtype": "string", "_type": "Value"}, "_type": "List"}, pa.list_(pa.string()), False),
    ],
)
def test_reads_as_pil_images_follows_hf_datasets(tmp_path, feature, column_type, decoded):
    """The image columns HF datasets 4.4 (verl's loader) decodes to PIL images, as its ``from_arrow_schema`` reads a
    file's footer (each case checked against it): an ``Image()`` feature in the schema metadata that matches the
    column's Arrow type."""
    schema = pa.schema([("images", column_type), ("index", pa.int64())])
    if feature is not None:
        schema = schema.with_metadata({"huggingface": json.dumps({"info": {"features": {"images": feature}}})})
    path = tmp_path / "images.parquet"
    pq.write_table(schema.empty_table(), path)
    assert reads_as_pil_images(pq.read_schema(path), "images") is decoded
    assert not reads_as_pil_images(pq.read_schema(path), "index")
