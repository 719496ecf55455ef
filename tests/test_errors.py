"""Bad input gets one clear error naming file, row and column (never only a traceback from inside Ray)."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest import BadRowError, ModelLoadError, SourceError, build_dataset
from ingest.errors import find_ingest_error
from tests.support.batches import collect


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _good(i):
    return {"prompt": [{"role": "user", "content": f"question {i}"}], "data_source": "x", "extra_info": {"index": i}}


def _consume_error(ds) -> BadRowError:
    with pytest.raises(BadRowError) as info:
        collect(ds)
    return find_ingest_error(info.value)


def test_missing_prompt_column(ray_session, model_dir, tmp_path):
    path = _write(tmp_path / "noprompt.parquet", [{"question": "q", "data_source": "x"}])
    with pytest.raises(SourceError) as info:
        build_dataset(path, model_dir, {})
    assert str(info.value).startswith(f"file {path}, column 'prompt': no prompt column 'prompt'")


STRICT = {"shuffle": False, "on_bad_row": "raise"}


def test_prompt_not_a_message_list(ray_session, model_dir, tmp_path):
    path = _write(tmp_path / "strprompt.parquet", [{"prompt": "just a string", "data_source": "x"}])
    err = _consume_error(build_dataset(path, model_dir, STRICT))
    assert (err.file, err.row, err.column) == (path, 0, "prompt")
    assert "list of chat messages" in str(err)


def test_message_without_role_names_its_row(ray_session, model_dir, tmp_path):
    rows = [_good(i) for i in range(5)]
    rows[3]["prompt"] = [{"role": None, "content": "no role"}]
    path = _write(tmp_path / "norole.parquet", rows)
    err = _consume_error(build_dataset(path, model_dir, STRICT))
    assert (err.file, err.row, err.column) == (path, 3, "prompt")
    assert "no 'role'" in err.reason


def test_bad_prompt_is_quarantined_by_default(ray_session, model_dir, tmp_path):
    import ray

    from ingest.stats import RunLedger

    rows = [_good(i) for i in range(5)]
    rows[1]["prompt"] = []
    rows[3]["prompt"] = [{"role": "user", "content": None}]
    path = _write(tmp_path / "mixed.parquet", rows)
    ledger = RunLedger.remote()
    batches = collect(build_dataset(path, model_dir, {"shuffle": False}, ledger=ledger))
    assert [int(i) for b in batches for i in b["index"]] == [0, 2, 4]
    records = ray.get(ledger.quarantine.remote())
    assert [(r["file"], r["row"], r["column"]) for r in records] == [(path, 1, "prompt"), (path, 3, "prompt")]
    assert records[0]["reason"] == "prompt is an empty message list"
    assert records[1]["reason"] == "message 0 (user) has content NoneType, expected a string"
    counts = ray.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (5, 3, 2)


def test_unreadable_file(ray_session, model_dir, tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SourceError) as info:
        build_dataset(str(path), model_dir, {})
    assert str(path) in str(info.value) and "cannot read as Parquet" in str(info.value)


def test_wrong_tokenizer_path(ray_session, tmp_path):
    path = _write(tmp_path / "ok.parquet", [_good(0)])
    with pytest.raises(ModelLoadError, match="tokenizer directory not found: /no/such/model"):
        build_dataset(path, "/no/such/model", {})
    with pytest.raises(ModelLoadError, match="no tokenizer_config.json"):
        build_dataset(path, str(tmp_path), {})


def test_cli_prints_one_line(tmp_path, model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "ingest", "run", "--files", str(tmp_path / "missing.parquet"), "--tokenizer", model_dir],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"ingest: error: file {tmp_path / 'missing.parquet'}: no such file or directory"
    )
    assert "Traceback" not in proc.stderr
