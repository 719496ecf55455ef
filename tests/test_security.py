"""Security: credentials stay out of errors, logs, summaries and quarantine records; no remote code unless the config
says so; nothing from the data or the config is imported, unpickled or executed; writes stay inside their directory.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest import IngestError, SourceError, build_dataset
from ingest.config import DataConfig
from ingest.errors import StoreError, find_ingest_error, redact, secret_values
from ingest.read.files import filesystem_for, inspect_files
from ingest.run import open_inside, run_pipeline, write_summary_json
from tests.support.batches import collect
from tests.support.s3 import moto_s3

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY-SECRET"
TOKEN = "FwoGZXIvYXdzEJr-SESSION-TOKEN-0123456789"
QUARANTINE = {"shuffle": False}


def _good(i):
    return {"prompt": [{"role": "user", "content": f"question {i}"}], "data_source": "x", "extra_info": {"index": i}}


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows) if isinstance(rows, list) else rows, path)
    return str(path)


def _files_containing(root: str | Path, needles: list[str]) -> list[str]:
    hits = []
    for path in Path(root).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {n[:6]}..." for n in needles if n.encode() in data]
    return hits


# --- credentials ------------------------------------------------------------------------------------------------------


def test_redact_removes_option_secrets_url_credentials_and_signed_url_tokens():
    options = {"key": "AKIDEXAMPLE", "secret": SECRET, "client_kwargs": {"endpoint_url": "http://minio:9000"}}
    options["config_kwargs"] = {"s3": {"session_token": TOKEN}}
    assert secret_values(options) == sorted([SECRET, TOKEN, "AKIDEXAMPLE"], key=len, reverse=True)
    text = (
        f"failed with {SECRET} and {TOKEN} at http://minio:9000 s3://AKID:{SECRET}@bucket/x "
        f"https://b.s3.amazonaws.com/i.png?X-Amz-Credential=AKID%2F1&X-Amz-Signature=abcdef0123&x=1"
    )
    clean = redact(text, secret_values(options))
    assert SECRET not in clean and TOKEN not in clean and "abcdef0123" not in clean and "AKID%2F1" not in clean
    assert "http://minio:9000" in clean and "s3://***@bucket/x" in clean and "&x=1" in clean
    # IngestError itself drops URL credentials (it does not know the options: callers redact those first)
    err = SourceError(f"Invalid bucket s3://AKID:{SECRET}@bucket/x", file=f"s3://AKID:{SECRET}@bucket/x")
    assert SECRET not in str(err) and SECRET not in repr(err) and err.file == "s3://***@bucket/x"
    assert SECRET not in str(pickle.loads(pickle.dumps(err)))


def test_webhdfs_token_is_not_in_the_error():
    """fsspec's WebHDFS puts the delegation token in the request URL, and requests echoes that URL on failure."""
    options = {"token": TOKEN}
    url = "webhdfs://127.0.0.1:1/user/rl/train.parquet"  # nothing listens on port 1
    with pytest.raises(SourceError) as info:
        inspect_files([url], options)
    message = str(info.value)
    assert "delegation=***" in message and "Connection" in message and TOKEN not in message
    # quarantine mode too: a store that cannot be reached is not a bad file, so the run stops (StoreError), token-free
    with pytest.raises(StoreError) as info:
        inspect_files([url, url.replace("train", "val")], options, bad=[])
    assert "delegation=***" in str(info.value) and TOKEN not in str(info.value) and TOKEN not in repr(info.value)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 endpoint holding one file with good rows, a bad row, and a non-Parquet object."""
    with moto_s3() as url:
        options = {"key": "AKIDEXAMPLE", "secret": SECRET, "token": TOKEN, "client_kwargs": {"endpoint_url": url}}
        rows = [_good(i) for i in range(6)]
        rows[2]["prompt"] = []
        local = _write(tmp_path_factory.mktemp("s3data") / "train.parquet", rows)
        fs = filesystem_for("s3://secure", options)
        fs.mkdir("secure")
        fs.put(local, "secure/data/train.parquet")
        fs.pipe("secure/data/zz-broken.parquet", b"not parquet at all")
        yield options


def test_s3_run_keeps_credentials_out_of_summary_quarantine_output_logs(ray_session, model_dir, s3, tmp_path, caplog):
    import ray

    out = tmp_path / "out"
    caplog.set_level(logging.WARNING, logger="ingest")
    summary = run_pipeline("s3://secure/data/", model_dir, {**QUARANTINE, "storage_options": s3}, output=str(out))
    assert (summary.rows_out, summary.quarantined, summary.files_quarantined) == (5, 1, 1)
    write_summary_json(summary, str(out / "summary.json"))
    assert {p.name for p in out.iterdir()} == {"part-00000.parquet", "quarantine.parquet", "summary.json"}
    records = pq.read_table(out / "quarantine.parquet").to_pylist()
    assert [r["file"] for r in records] == ["s3://secure/data/zz-broken.parquet", "s3://secure/data/train.parquet"]
    needles = [SECRET, TOKEN]
    assert _files_containing(out, needles) == []
    assert not any(n in summary.format() or n in json.dumps(summary.to_dict()) for n in needles)
    assert not any(n in caplog.text for n in needles) and "zz-broken.parquet" in caplog.text
    logs = ray._private.worker._global_node.get_logs_dir_path()  # every Ray process of this session logs here
    assert os.listdir(logs) and _files_containing(logs, needles) == []


def test_credentials_in_the_url_are_not_in_the_error(ray_session, model_dir, s3):
    """``s3://key:secret@bucket``: botocore rejects the bucket name and quotes it in full."""
    url = f"s3://AKIDEXAMPLE:{SECRET}@secure/data/train.parquet"
    for config in ({"storage_options": s3}, {"storage_options": s3, "on_bad_row": "raise"}):
        with pytest.raises(SourceError) as info:
            run_pipeline([url], model_dir, config)
        assert "Invalid bucket name" in info.value.reason
        assert SECRET not in str(info.value) and SECRET not in repr(info.value)
        assert info.value.file == "s3://secure/data/train.parquet"


# --- remote code, hooks, pickles --------------------------------------------------------------------------------------


def _model_with_remote_code(model_dir: str, tmp_path: Path) -> tuple[str, Path]:
    """A copy of the model whose configs point (auto_map) at a module that leaves a marker file when imported."""
    model = tmp_path / "model-with-code"
    shutil.copytree(model_dir, model)
    marker = tmp_path / "remote-code-ran"
    (model / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\n"
        "from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessor, Qwen2VLVideoProcessor\n"
        "class CustomTokenizer(Qwen2TokenizerFast):\n    pass\n"
        "class CustomImageProcessor(Qwen2VLImageProcessor):\n    pass\n"
        "class CustomVideoProcessor(Qwen2VLVideoProcessor):\n    pass\n"
    )
    maps = {
        "tokenizer_config.json": {"AutoTokenizer": ["custom_code.CustomTokenizer", "custom_code.CustomTokenizer"]},
        "preprocessor_config.json": {"AutoImageProcessor": "custom_code.CustomImageProcessor"},
        "video_preprocessor_config.json": {"AutoVideoProcessor": "custom_code.CustomVideoProcessor"},
    }
    for name, auto_map in maps.items():
        config = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**config, "auto_map": auto_map}))
    return str(model), marker


def test_remote_code_is_not_run_unless_the_config_allows_it(ray_session, model_dir, tmp_path, monkeypatch):
    from ingest.stages.vision import VisionStage
    from ingest.tokenizer.chat import ChatTokenizer

    model, marker = _model_with_remote_code(model_dir, tmp_path)
    path = _write(tmp_path / "ok.parquet", [_good(i) for i in range(3)])
    summary = run_pipeline([path], model, QUARANTINE)  # tokenizer actors: AutoTokenizer (auto_map), no remote code
    assert summary.rows_out == 3 and not marker.exists()
    vision = VisionStage(
        model, DataConfig(vision_device="cpu")
    )  # image and video processors load without the custom classes
    assert type(vision.image_processor).__name__ != "CustomImageProcessor"
    assert type(vision.video_processor).__name__ != "CustomVideoProcessor"
    assert not marker.exists()
    # the control: trust_remote_code: true does import it (so the checks above could have seen it)
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    ChatTokenizer(model, trust_remote_code=True)
    assert marker.read_text() == "imported\n"


def test_config_hooks_are_never_imported(ray_session, model_dir, tmp_path, monkeypatch):
    """verl's ``chat_template_func`` / ``custom_cls`` name code to import; here they are accepted and ignored."""
    from ingest.cli import load_run_config

    marker = tmp_path / "hook-ran"
    hook = (
        f"open({str(marker)!r}, 'a').write('imported')\ndef render(*a, **k):\n    return ''\nclass Dataset:\n    pass\n"
    )
    (tmp_path / "evil_hook.py").write_text(hook)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path / "ok.parquet", [_good(i) for i in range(3)])
    config = {
        **QUARANTINE,
        "chat_template_func": "evil_hook.render",
        "custom_cls": {"path": str(tmp_path / "evil_hook.py"), "name": "Dataset"},
    }
    summary = run_pipeline([path], model_dir, config)
    assert summary.rows_out == 3 and not marker.exists()
    # YAML configs are loaded with safe_load: no python/object tags
    (tmp_path / "run.yaml").write_text(f"data:\n  x: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(Exception, match="could not determine a constructor"):
        load_run_config(str(tmp_path / "run.yaml"))
    assert not marker.exists()
    # and the control: importing the module does leave the marker
    __import__("evil_hook")
    assert marker.exists()


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'a').write('unpickled')",))


def _pickle_column_file(path: Path, marker: Path) -> str:
    import ray.data  # noqa: F401  (registers Ray's extension types)
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectType

    payload = pa.array([pickle.dumps(_Payload(str(marker)))] * 2, pa.large_binary())
    prompts = pa.ExtensionArray.from_storage(ArrowPythonObjectType(), payload)
    return _write(path, pa.table({"prompt": prompts, "data_source": ["x", "x"]}))


def test_pickled_python_columns_are_never_unpickled(ray_session, model_dir, tmp_path):
    marker = tmp_path / "unpickled"
    evil = _pickle_column_file(tmp_path / "evil.parquet", marker)
    good = _write(tmp_path / "good.parquet", [_good(i) for i in range(3)])
    summary = run_pipeline([good, evil], model_dir, QUARANTINE, output=str(tmp_path / "out"))
    assert (summary.rows_out, summary.quarantined, summary.files_quarantined) == (3, 2, 1)
    (record,) = pq.read_table(summary.quarantine_file).to_pylist()
    assert record["file"] == evil and record["column"] == "prompt" and "pickled Python objects" in record["reason"]
    with pytest.raises(SourceError, match="pickled Python objects"):
        run_pipeline([good, evil], model_dir, {**QUARANTINE, "on_bad_row": "raise"})
    with pytest.raises(SourceError, match="pickled Python objects"):
        build_dataset(evil, model_dir, QUARANTINE)
    assert not marker.exists()
    # the control: this file does run code when read the plain way
    pq.read_table(evil).column("prompt").to_pylist()
    assert marker.read_text() == "unpickled" * 2


def test_pickled_columns_refused_without_ray_extension_types_registered(tmp_path):
    """The footer check also works from the raw extension metadata (a process that has not imported ray.data)."""
    payload = pa.array([b"\x80\x04N."], pa.large_binary())
    field = pa.field("prompt", pa.large_binary(), metadata={"ARROW:extension:name": "ray.data.arrow_pickled_object"})
    _write(tmp_path / "meta.parquet", pa.table([payload], schema=pa.schema([field])))
    with pytest.raises(SourceError, match="pickled Python objects"):
        inspect_files([str(tmp_path / "meta.parquet")])


def test_prompt_text_is_data_not_template(ray_session, model_dir, tmp_path):
    marker = tmp_path / "template-ran"
    injected = (
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }} {% for x in range(3) %}x{% endfor %}"
    )
    path = _write(tmp_path / "inject.parquet", [{**_good(0), "prompt": [{"role": "user", "content": injected}]}])
    batch = collect(build_dataset(path, model_dir, {**QUARANTINE, "return_full_prompt": True}))[0]
    assert injected in batch["full_prompts"][0] and not marker.exists()


# --- where files are written ------------------------------------------------------------------------------------------


def test_output_names_never_come_from_data_and_links_are_not_followed(ray_session, model_dir, tmp_path):
    rows = [{**_good(i), "data_source": "../../escape", "../up": "/etc/passwd"} for i in range(3)]
    rows[1]["prompt"] = [{"role": "user", "content": None}]  # one quarantine record
    path = _write(tmp_path / "paths.parquet", rows)
    out = tmp_path / "nested" / "out"
    summary = run_pipeline([path], model_dir, QUARANTINE, output=str(out))
    assert summary.rows_out == 2 and summary.quarantined == 1
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["nested/out/part-00000.parquet", "nested/out/quarantine.parquet", "paths.parquet"]
    # a link planted where a part file goes is refused, not followed
    shutil.rmtree(out)
    out.mkdir()
    (out / "part-00000.parquet").symlink_to(tmp_path / "outside.parquet")
    with pytest.raises(IngestError, match="refusing to write through a symlink"):
        run_pipeline([path], model_dir, QUARANTINE, output=str(out))
    assert not (tmp_path / "outside.parquet").exists()
    for name in ("../x.parquet", "a/b.parquet", "..", ""):
        with pytest.raises(ValueError, match="not a plain file name"):
            open_inside(out, name)


def test_quarantine_file_does_not_follow_links(ray_session, model_dir, tmp_path):
    rows = [_good(0), {**_good(1), "prompt": []}]
    path = _write(tmp_path / "q.parquet", rows)
    qdir = tmp_path / "q"
    qdir.mkdir()
    (qdir / "quarantine.parquet").symlink_to(tmp_path / "elsewhere.parquet")
    with pytest.raises(IngestError, match="refusing to write through a symlink") as info:
        run_pipeline([path], model_dir, QUARANTINE, quarantine_dir=str(qdir))
    assert find_ingest_error(info.value) is info.value
    assert not (tmp_path / "elsewhere.parquet").exists()


def test_config_repr_leaves_out_storage_options():
    from ingest import DataConfig

    cfg = DataConfig(storage_options={"key": "AKIAEXAMPLE", "secret": "s3cr3t-value-123"})
    assert "s3cr3t-value-123" not in repr(cfg) and "AKIAEXAMPLE" not in repr(cfg)
    assert cfg.storage_options["secret"] == "s3cr3t-value-123"
