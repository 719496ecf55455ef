"""Remote stores through the pipeline: a real S3 endpoint (moto server), a WebHDFS endpoint, HDFS when configured.
Local input resolution is tests/read/test_files.py."""

from __future__ import annotations

import os
import shutil

import pytest

from ingest import SourceError, build_dataset
from ingest.read.files import expand_files, filesystem_for
from tests.support.batches import collect
from tests.support.compare import assert_same_batches
from tests.support.s3 import moto_s3
from tests.support.webhdfs import WebHDFSServer

CONFIG = {"truncation": "left", "shuffle": False, "return_raw_chat": True}


@pytest.fixture(scope="module")
def local_batches(ray_session, variety_files, model_dir):
    return collect(build_dataset(variety_files, model_dir, CONFIG))


@pytest.fixture(scope="module")
def s3_endpoint(variety_files):
    with moto_s3() as url:
        options = {"key": "testing-key", "secret": "testing-secret", "client_kwargs": {"endpoint_url": url}}
        fs = filesystem_for("s3://bucket", options)
        fs.mkdir("prompts")
        for path in variety_files:
            fs.put(path, f"prompts/gsm8k/{os.path.basename(path)}")
        yield options


def test_s3_reads_stream_from_a_real_endpoint(ray_session, model_dir, s3_endpoint, local_batches):
    files = expand_files("s3://prompts/gsm8k/", s3_endpoint)
    assert [f.rsplit("/", 1)[1] for f in files] == ["train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    assert all(f.startswith("s3://prompts/gsm8k/") for f in files)
    ds = build_dataset("s3://prompts/gsm8k/", model_dir, {**CONFIG, "storage_options": s3_endpoint})
    assert_same_batches(collect(ds), local_batches)


def test_s3_glob_and_missing_key(ray_session, model_dir, s3_endpoint):
    assert len(expand_files("s3://prompts/gsm8k/train-*.parquet", s3_endpoint)) == 3
    with pytest.raises(SourceError, match="s3://prompts/nothing.parquet"):
        build_dataset("s3://prompts/nothing.parquet", model_dir, {**CONFIG, "storage_options": s3_endpoint})


def test_webhdfs_reads_through_fsspec_client(ray_session, model_dir, variety_files, local_batches, tmp_path):
    root = tmp_path / "hdfs-root"
    (root / "user" / "rl").mkdir(parents=True)
    for path in variety_files:
        shutil.copy(path, root / "user" / "rl")
    with WebHDFSServer(str(root)) as server:
        url = f"webhdfs://127.0.0.1:{server.port}/user/rl"
        files = expand_files(url)
        assert files == [f"{url}/train-0000{i}.parquet" for i in range(3)]
        assert_same_batches(collect(build_dataset(url, model_dir, CONFIG)), local_batches)
        assert "OPEN" in server.requests and "LISTSTATUS" in server.requests


@pytest.mark.skipif(not os.environ.get("INGEST_TEST_HDFS_URL"), reason="set INGEST_TEST_HDFS_URL=hdfs://host:port/dir")
def test_real_hdfs(ray_session, model_dir, variety_files, local_batches):
    """Copies the test files to a real HDFS directory and reads them back through the pipeline."""
    url = os.environ["INGEST_TEST_HDFS_URL"].rstrip("/")
    fs = filesystem_for(url)
    for path in variety_files:
        fs.put(path, f"{url}/{os.path.basename(path)}")
    files = [f"{url}/{os.path.basename(p)}" for p in variety_files]
    assert_same_batches(collect(build_dataset(files, model_dir, CONFIG)), local_batches)


def test_s3_without_s3fs_reads_through_pyarrow_the_same_rows(model_dir, s3_endpoint, local_batches, tmp_path):
    """Where s3fs is not installed (it needs botocore, which caps python-dateutil below 3; verl 0.9's environment has
    4), s3:// is read by pyarrow's own S3 filesystem with the same storage options: the same rows, through a cluster
    whose every process lacks s3fs. An option only s3fs has is refused by name."""
    import subprocess
    import sys

    import torch

    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "s3fs.py").write_text("raise ImportError('s3fs is not installed')\n")
    out = tmp_path / "batches.pt"
    code = f"""
import ray, torch
from ingest import SourceError, build_dataset
from ingest.read.files import filesystem_for
from tests.support.batches import collect
options = {s3_endpoint!r}
assert type(filesystem_for("s3://prompts", options)).__name__ == "ArrowFSWrapper"
try:
    filesystem_for("s3://prompts", {{**options, "config_kwargs": {{}}}})
except SourceError as e:
    print("refused:", e)
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
config = {{**{CONFIG!r}, "storage_options": options}}
torch.save(collect(build_dataset("s3://prompts/gsm8k/", {model_dir!r}, config)), {str(out)!r})
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.getcwd()])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: file s3://prompts: storage_options ['config_kwargs'] need s3fs" in done.stdout, done.stdout
    assert_same_batches(torch.load(out, weights_only=False), local_batches)
