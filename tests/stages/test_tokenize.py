"""The tokenize stage's bad media rows in overlong prompts (``ingest/stages/tokenize.py``): with the overlong filter
off and truncation on, a row whose image does not read is quarantined for its image, not re-judged by truncation."""

from __future__ import annotations

import pyarrow as pa
import pytest

from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.config import DataConfig, StageContext
from ingest.media.geometry import VisionSpec
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.tokenizer.chat import ChatTokenizer
from tools.samples import geo3k_rows, geo3k_schema


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_a_bad_image_in_an_overlong_prompt_is_quarantined_for_its_image(model_dir, truncation):
    rows = geo3k_rows(5, seed=3)  # row 4 has two images
    for i, k in ((0, 0), (4, 1)):  # the only image of row 0, the second of row 4
        rows[i]["images"][k]["bytes"] = b"not an image"
        rows[i]["prompt"][0]["content"] = "word " * 1500 + rows[i]["prompt"][0]["content"]
    table = pa.Table.from_pylist(rows, schema=geo3k_schema())
    table = table.append_column(FILE_COLUMN, pa.array([0] * 5, pa.int32()))
    table = table.append_column(ROW_COLUMN, pa.array(range(5), pa.int64()))
    config = DataConfig(filter_overlong_prompts=False, truncation=truncation, max_prompt_length=1024)
    stage = PromptTokenizeStage(
        ChatTokenizer(model_dir), config, StageContext(files=["geo3k.parquet"]), VisionSpec.from_dir(model_dir)
    )
    result = stage(table)
    assert [(r["row"], r["column"], r["reason"].split(":")[0]) for r in result.quarantine] == [
        (0, "images", "bad image"),
        (4, "images", "bad image"),
    ]
    assert result.counts.rows_in == 5 and result.counts.quarantined == 2
