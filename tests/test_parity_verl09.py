"""``row_format: verl-0.9`` against verl 0.9.1 itself (transformers 5.9 beside it): ``raw_prompt`` rows with their
content items (text, RGB PIL images, video sources), ``dummy_tensor``, the passthrough and extra_info keys, batch by
batch, with verl 0.9.1's overlong filter on and off; text, images of every kind (HF ``Image()`` columns, plain
``{bytes, path}`` structs without that metadata, path strings), videos (frame lists and files). verl 0.8.0 (its
rows are 0.9.1's) is checked as a second oracle on a subset: text, and Qwen2-VL images from ``Image()`` columns and
plain structs (``*_verl_08``)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.demo import gsm8k_rows
from ingest.errors import BadRowError, find_ingest_error
from ingest.run import run_pipeline
from tests.support import formats
from tests.support.compare import assert_same, assert_same_batches
from tests.support.media import write_path_string_image_rows
from tests.support.tiers import first_fast, first_in_matrix, slow
from tools.oracle import OracleServer, oracle_available
from tools.samples import (
    geo3k_rows,
    geo3k_schema,
    qwen3_vl_model_dir,
    qwen25_vl_model_dir,
    write_video_parquet,
)

ROW_FORMAT = "verl-0.9"
BATCH = 8
pytestmark = pytest.mark.skipif(
    not oracle_available(ROW_FORMAT), reason="verl 0.9.1 oracle not installed (make oracle)"
)
# verl 0.9 has no truncation: truncation modes change nothing, the filter (and its limit) decides which rows stay
TEXT_CONFIGS = [
    {"filter_overlong_prompts": True},
    {"filter_overlong_prompts": True, "max_prompt_length": 97, "truncation": "left"},
    {"filter_overlong_prompts": False, "max_prompt_length": 97, "truncation": "error"},
    {"filter_overlong_prompts": True, "max_prompt_length": 512, "prompt_key": "prompt", "return_raw_chat": False},
]
IMAGE_CONFIGS = [
    {"filter_overlong_prompts": True, "max_prompt_length": 640},
    {"filter_overlong_prompts": True, "max_prompt_length": 2048},
    {"filter_overlong_prompts": False, "max_prompt_length": 64},
]


# verl 0.8.0, a second oracle of verl-0.9 (.oracle-0.8, run in front of .oracle-0.9): it has the same RLHFDataset rows
# as 0.9.1 but for path-string images / videos, which its __getitem__ rejects (TypeError) and its filter drops, and
# for image_patch_size's default (14 always; 0.9.1 takes the processor's, 14 for Qwen2-VL)
VERL_08 = "verl-0.8.0"
requires_verl_08 = pytest.mark.skipif(
    not oracle_available(VERL_08), reason="verl 0.8.0 oracle not installed (make oracle)"
)
_OURS: dict[str, list[dict]] = {}  # our batches per (files, model, config, processor): the 0.8.0 tests reuse them


@pytest.fixture(scope="module", autouse=True)
def _forget_ours_and_verl_08():
    """At the module's end: our cached batches, and the verl 0.8.0 runner (only this module asks it)."""
    yield
    _OURS.clear()
    if server := OracleServer._running.get(VERL_08):
        server.close()


def _ours(files, model_dir, config: dict, processor=None, batch_size: int = BATCH) -> list[dict]:
    key = json.dumps([list(files), model_dir, config, processor, batch_size], sort_keys=True)
    if key not in _OURS:
        _OURS[key] = formats.ours(files, model_dir, config, ROW_FORMAT, batch_size, processor)
    return _OURS[key]


def _verl(files, model_dir, configs: list[dict], cache, processor=None, batch_size: int = BATCH) -> list[dict]:
    return formats.verl(files, model_dir, configs, cache, ROW_FORMAT, batch_size, processor)


def _verl_08(files, model_dir, configs: list[dict], cache, processor=None, batch_size: int = BATCH) -> list[dict]:
    """What ``_verl`` runs, with verl 0.8.0 as the oracle."""
    return formats.verl(files, model_dir, configs, cache, VERL_08, batch_size, processor)


@pytest.fixture(scope="module")
def text_runs(variety_files, model_dir, tmp_path_factory):
    return _verl(variety_files, model_dir, TEXT_CONFIGS, tmp_path_factory.mktemp("verl-cache"))


@pytest.mark.parametrize("index", first_fast(range(len(TEXT_CONFIGS)), ids=[str(c) for c in TEXT_CONFIGS], matrix=True))
def test_text_rows_equal_verl_09(ray_session, variety_files, model_dir, text_runs, index):
    expected = text_runs[index]
    assert "error" not in expected, expected.get("error")
    ours = _ours(variety_files, model_dir, TEXT_CONFIGS[index])
    assert_same_batches(ours, expected["batches"])
    assert "input_ids" not in ours[0] and ours[0]["prompt"][0] is ours[0]["raw_prompt"][0]  # one object, as in verl


@pytest.fixture(scope="module")
def text_runs_08(variety_files, model_dir, tmp_path_factory):
    return _verl_08(variety_files, model_dir, TEXT_CONFIGS, tmp_path_factory.mktemp("verl08-cache"))


@slow
@requires_verl_08
@pytest.mark.parametrize("index", range(len(TEXT_CONFIGS)), ids=[str(c) for c in TEXT_CONFIGS])
def test_text_rows_equal_verl_08(ray_session, variety_files, model_dir, text_runs_08, index):
    """verl 0.8.0 itself (transformers 5.9): the same rows as 0.9.1's, filter on and off."""
    expected = text_runs_08[index]
    assert "error" not in expected, expected.get("error")
    assert_same_batches(_ours(variety_files, model_dir, TEXT_CONFIGS[index]), expected["batches"])


MAX_SAMPLES_CONFIGS = [
    {"shuffle": True, "seed": 7, "filter_overlong_prompts": True, "max_prompt_length": 256},
    {"shuffle": False, "filter_overlong_prompts": True, "max_prompt_length": 256},
]


@pytest.mark.parametrize("index", range(len(MAX_SAMPLES_CONFIGS)), ids=["shuffled, seed 7", "not shuffled"])
def test_max_samples_draws_the_rows_verl_09_draws(ray_session, model_dir, tmp_path, index):
    """``data.train_max_samples`` (the dataset's ``max_samples``): verl 0.9.1 draws 60 of 300 rows (two files) from
    its loaded table before its filter, seeded by ``data.seed`` where ``data.shuffle``, else the first 60. Ours
    draws the same rows from the footers' count, before the stream (``IngestDataset``, as verl's trainer builds
    it): the same rows after the filter, each equal; without shuffle in the same order."""
    from ingest.demo import write_gsm8k_parquet
    from ingest.verl import IngestDataset

    files = write_gsm8k_parquet(tmp_path / "data", 300, num_files=2, row_group_size=50, long_every=7)
    config = MAX_SAMPLES_CONFIGS[index]
    expected = _verl(files, model_dir, [{**config, "max_samples": 60}], tmp_path / "verl-cache")[0]
    assert "error" not in expected, expected.get("error")
    dataset = IngestDataset(files, model_dir, None, {**config, "row_format": ROW_FORMAT}, max_samples=60)
    ours = list(dataset.loader(BATCH, drop_last=False, shuffle=False))
    assert 40 < len(dataset) == len(expected["rows"]) < 60  # drawn, then filtered
    if not config["shuffle"]:
        assert_same_batches(ours, expected["batches"])
        return

    # verl's table is in its draw's order; ours reads the drawn rows in file order: the same rows, each equal
    def by_index(batches: list[dict]) -> dict:
        return {
            int(index): {key: batch[key][i] for key in batch}
            for batch in batches
            for i, index in enumerate(batch["index"])
        }

    mine, theirs = by_index(ours), by_index(expected["batches"])
    assert sorted(mine) == sorted(theirs) and len(theirs) == len(expected["rows"])
    for index, row in theirs.items():
        assert_same(mine[index], row, f"row {index}")
    assert list(theirs) != sorted(theirs)  # verl's order is its draw's, not the files'


@slow
def test_rows_without_or_with_null_extra_info_equal_verl_09(ray_session, model_dir, tmp_path):
    rows = gsm8k_rows(40, variety=True, long_every=9)
    without = [{k: v for k, v in row.items() if k != "extra_info"} for row in rows]
    with_nulls = [{**row, "extra_info": None} if i % 3 == 0 else row for i, row in enumerate(rows)]
    for name, table_rows in (("no-extra-info", without), ("null-extra-info", with_nulls)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table_rows), path, row_group_size=16)
        expected = _verl([str(path)], model_dir, [TEXT_CONFIGS[0]], tmp_path / "verl-cache")[0]
        assert "error" not in expected, expected.get("error")
        assert_same_batches(_ours([str(path)], model_dir, TEXT_CONFIGS[0]), expected["batches"])


@slow
def test_audio_column_leaves_the_rows_as_in_verl_09(ray_session, model_dir, tmp_path):
    """verl 0.9.1 pops its ``audio_key`` column from every row; a row with audio it makes audio items of (or asserts,
    without ``<audio>`` placeholders): ours builds no audio prompts, so that row is bad, named by file, row and
    column."""
    rows = [{**row, "audios": None if i % 2 else []} for i, row in enumerate(gsm8k_rows(16, variety=True))]
    path = tmp_path / "audio-column.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=8)
    expected = _verl([str(path)], model_dir, [TEXT_CONFIGS[0]], tmp_path / "verl-cache")[0]
    assert "error" not in expected, expected.get("error")
    ours = _ours([str(path)], model_dir, TEXT_CONFIGS[0])
    assert_same_batches(ours, expected["batches"])
    assert "audios" not in ours[0]

    rows[5]["audios"] = ["clip.wav"]
    with_audio = tmp_path / "with-audio.parquet"
    pq.write_table(pa.Table.from_pylist(rows), with_audio, row_group_size=8)
    assert (
        "AssertionError" in _verl([str(with_audio)], model_dir, [TEXT_CONFIGS[0]], tmp_path / "verl-cache")[0]["error"]
    )
    with pytest.raises(BadRowError) as info:
        _ours([str(with_audio)], model_dir, {**TEXT_CONFIGS[0], "on_bad_row": "raise"})
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column) == (str(with_audio), 5, "audios") and "audio prompts" in err.reason


@pytest.fixture(scope="module")
def image_runs(geo3k_files, model_dir, tmp_path_factory):
    return _verl(geo3k_files, model_dir, IMAGE_CONFIGS, tmp_path_factory.mktemp("verl-cache"), processor=model_dir)


@slow
@pytest.mark.parametrize("index", first_in_matrix(range(len(IMAGE_CONFIGS)), ids=[str(c) for c in IMAGE_CONFIGS]))
def test_image_rows_equal_verl_09(ray_session, geo3k_files, model_dir, image_runs, index):
    """Every image kind (RGBA, L, P, CMYK, extreme sizes; several per row): RGB PIL images in the content items, the
    filter's expanded lengths from headers and the two resizes."""
    expected = image_runs[index]
    assert "error" not in expected, expected.get("error")
    assert (len(expected["rows"]) < 48) == (index == 0)  # 640 tokens: the filter drops the rows with large images
    assert_same_batches(_ours(geo3k_files, model_dir, IMAGE_CONFIGS[index], processor=model_dir), expected["batches"])


@pytest.fixture(scope="module")
def image_runs_08(geo3k_files, model_dir, tmp_path_factory):
    return _verl_08(geo3k_files, model_dir, IMAGE_CONFIGS, tmp_path_factory.mktemp("verl08-cache"), processor=model_dir)


@slow
@requires_verl_08
@pytest.mark.parametrize("index", range(len(IMAGE_CONFIGS)), ids=[str(c) for c in IMAGE_CONFIGS])
def test_image_rows_equal_verl_08(ray_session, geo3k_files, model_dir, image_runs_08, index):
    """verl 0.8.0 on the HF ``Image()`` columns with the Qwen2-VL processor: the rows and the filter's choices of
    0.9.1 (its default image_patch_size of 14 is Qwen2-VL's patch)."""
    expected = image_runs_08[index]
    assert "error" not in expected, expected.get("error")
    assert (len(expected["rows"]) < 48) == (index == 0)
    assert_same_batches(_ours(geo3k_files, model_dir, IMAGE_CONFIGS[index], processor=model_dir), expected["batches"])


def _image_items(batches: list[dict]) -> list[dict]:
    return [
        item
        for batch in batches
        for messages in batch["raw_prompt"]
        for message in messages
        if isinstance(message["content"], list)
        for item in message["content"]
        if item["type"] == "image"
    ]


@pytest.fixture(scope="module")
def plain_struct_files(geo3k_files, tmp_path_factory):
    """The geo3k files without their schema metadata: HF datasets (so verl) reads the images as plain
    ``{bytes, path}`` dicts; every 7th row's structs have null bytes and a path."""
    out = tmp_path_factory.mktemp("geo3k-plain")
    paths = []
    for path in geo3k_files:
        target = out / path.rsplit("/", 1)[-1]
        pq.write_table(pq.read_table(path).replace_schema_metadata(None), target, row_group_size=12)
        paths.append(str(target))
    return paths


@pytest.fixture(scope="module")
def plain_struct_runs(plain_struct_files, model_dir, tmp_path_factory):
    return _verl(
        plain_struct_files, model_dir, IMAGE_CONFIGS, tmp_path_factory.mktemp("verl-cache"), processor=model_dir
    )


@slow
@pytest.mark.parametrize("index", range(2), ids=[str(c) for c in IMAGE_CONFIGS[:2]])
def test_plain_image_struct_rows_equal_verl_09(ray_session, plain_struct_files, model_dir, plain_struct_runs, index):
    """Image structs read without an HF ``Image()`` feature: verl 0.9.1's items keep the struct's ``bytes`` and
    ``path`` beside ``Image.open(BytesIO(bytes))``, not converted (L, P, RGBA stay). Its filter drops the rows whose
    structs hold only a path (opening null bytes fails there); ours quarantines them: the same rows remain."""
    expected = plain_struct_runs[index]
    assert "error" not in expected, expected.get("error")
    # the 7 path-only rows go, and at 640 tokens the rows with large images too
    assert len(expected["rows"]) <= 48 - 7 and (len(expected["rows"]) < 48 - 7) == (index == 0)
    ours = _ours(plain_struct_files, model_dir, IMAGE_CONFIGS[index], processor=model_dir)
    assert_same_batches(ours, expected["batches"])
    items = _image_items(ours)
    assert {tuple(item) for item in items} == {("type", "bytes", "path", "image")}
    assert {"L", "P", "RGBA"} <= {item["image"].mode for item in items}


@pytest.fixture(scope="module")
def plain_struct_runs_08(plain_struct_files, model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("verl08-cache")
    return _verl_08(plain_struct_files, model_dir, IMAGE_CONFIGS[:2], cache, processor=model_dir)


@slow
@requires_verl_08
@pytest.mark.parametrize("index", range(2), ids=[str(c) for c in IMAGE_CONFIGS[:2]])
def test_plain_image_struct_rows_equal_verl_08(ray_session, plain_struct_files, model_dir, plain_struct_runs_08, index):
    """verl 0.8.0 on plain ``{bytes, path}`` structs: the items and the rows its filter keeps (path-only structs
    dropped) are 0.9.1's."""
    expected = plain_struct_runs_08[index]
    assert "error" not in expected, expected.get("error")
    assert len(expected["rows"]) <= 48 - 7 and (len(expected["rows"]) < 48 - 7) == (index == 0)
    ours = _ours(plain_struct_files, model_dir, IMAGE_CONFIGS[index], processor=model_dir)
    assert_same_batches(ours, expected["batches"])


@slow
def test_plain_image_struct_rows_without_the_filter_equal_verl_09(
    ray_session, plain_struct_files, model_dir, plain_struct_runs, tmp_path
):
    """Filter off: verl 0.9.1 raises on a path-only struct (``__getitem__`` opens its null bytes); ours makes it a
    bad row naming file, row and column. Structs that all hold bytes (fields in the order path, bytes; paths set)
    give verl's rows exactly."""
    config = IMAGE_CONFIGS[2]
    assert "UnidentifiedImageError" in plain_struct_runs[2]["error"]
    rows_with_paths = [(plain_struct_files[i // 24], i % 24, "images") for i in range(3, 48, 7)]  # 24 rows a file
    with pytest.raises(BadRowError) as info:
        _ours(plain_struct_files, model_dir, {**config, "on_bad_row": "raise"}, processor=model_dir)
    err = find_ingest_error(info.value)  # the first block to fail names its row: the files' units run in parallel
    assert (err.file, err.row, err.column) in rows_with_paths and "null or empty bytes" in err.reason
    summary = run_pipeline(
        plain_struct_files,
        model_dir,
        {**config, "row_format": ROW_FORMAT},
        processor=model_dir,
        quarantine_dir=str(tmp_path / "quarantine"),
    )
    records = pq.read_table(summary.quarantine_file).to_pylist()
    assert sorted((r["file"], r["row"], r["column"]) for r in records) == rows_with_paths
    assert (summary.rows_out, summary.quarantined) == (48 - 7, 7)

    rows = geo3k_rows(16, seed=1)
    for row in rows:
        row["images"] = [
            {"path": f"figure-{row['extra_info']['index']}.png", "bytes": image["bytes"]} for image in row["images"]
        ]
    struct = pa.struct([("path", pa.string()), ("bytes", pa.binary())])
    schema = geo3k_schema().remove_metadata()
    schema = schema.set(schema.get_field_index("images"), pa.field("images", pa.list_(struct)))
    path = tmp_path / "path-then-bytes.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=8)
    expected = _verl([str(path)], model_dir, [config], tmp_path / "verl-cache", processor=model_dir)[0]
    assert "error" not in expected, expected.get("error")
    ours = _ours([str(path)], model_dir, config, processor=model_dir)
    assert_same_batches(ours, expected["batches"])
    assert {tuple(item) for item in _image_items(ours)} == {("type", "path", "bytes", "image")}


@slow
def test_image_path_strings_equal_verl_09(ray_session, model_dir, tmp_path):
    """Image values as plain path strings: verl 0.9.1's item holds the path string (``os.fspath``), with the filter
    on and off. Not run against verl 0.8.0: its ``__getitem__`` raises TypeError on a path string and its filter
    drops the row (0.9.1 accepts path-string images and videos; ours builds 0.9.1's rows)."""
    path = write_path_string_image_rows(tmp_path)
    configs = IMAGE_CONFIGS[1:]
    runs = _verl([path], model_dir, configs, tmp_path / "verl-cache", processor=model_dir)
    for config, expected in zip(configs, runs, strict=True):
        assert "error" not in expected, expected.get("error")
        ours = _ours([path], model_dir, config, processor=model_dir)
        assert_same_batches(ours, expected["batches"])
        assert all(isinstance(item["image"], str) for item in _image_items(ours))


@slow
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_other_families_image_rows_equal_verl_09(ray_session, geo3k_files, model_dir, tmp_path_factory, family):
    """Qwen2.5-VL (a larger pixel budget) and Qwen3-VL (patch 16: qwen-vl-utils resizes by 32, then its processor)
    processors built offline: the filter drops the same rows at 640 and 2048 tokens."""
    build = qwen25_vl_model_dir if family == "qwen2.5-vl" else qwen3_vl_model_dir
    model = build(tmp_path_factory.mktemp(family), model_dir)
    configs = [{"filter_overlong_prompts": True, "max_prompt_length": n} for n in (640, 2048)]
    runs = _verl(geo3k_files, model, configs, tmp_path_factory.mktemp("verl-cache"), processor=model)
    for config, expected in zip(configs, runs, strict=True):
        assert "error" not in expected, expected.get("error")
        assert_same_batches(_ours(geo3k_files, model, config, processor=model), expected["batches"])


@slow
@pytest.mark.parametrize("kind,limit", [("frames", 700), ("file", 600)])
def test_qwen3_vl_video_rows_equal_verl_09(ray_session, model_dir, tmp_path, kind, limit):
    """Qwen3-VL video prompts, measured from headers: qwen-vl-utils sizes by the patch of 16 verl passes, the video
    processor's budget counts every frame, and its processor writes ``<t seconds>`` before each temporal patch (from
    the sampled frames' times). Frame lists beside an image, and MPEG-4 files; the limit drops some rows of each."""
    model = qwen3_vl_model_dir(tmp_path / "qwen3-vl", model_dir)
    files = write_video_parquet(tmp_path / "videos", 12, kind=kind, with_images=kind == "frames")
    config = {"filter_overlong_prompts": True, "max_prompt_length": limit}
    expected = _verl(files, model, [config], tmp_path / "verl-cache", processor=model)[0]
    assert "error" not in expected, expected.get("error")
    assert 0 < len(expected["rows"]) < 12
    assert_same_batches(_ours(files, model, config, processor=model), expected["batches"])


@slow
@pytest.mark.parametrize(
    "kind,with_images,limit", first_in_matrix([("frames", False, 700), ("file", False, 1100), ("frames", True, 2048)])
)
def test_video_rows_equal_verl_09(ray_session, model_dir, tmp_path, kind, with_images, limit):
    """Video items are the row's own sources; the filter measures each video from its header (at 700 tokens
    it drops a frame-list row with two long videos)."""
    files = write_video_parquet(tmp_path / "data", 12, kind=kind, with_images=with_images)
    config = {"filter_overlong_prompts": True, "max_prompt_length": limit}
    expected = _verl(files, model_dir, [config], tmp_path / "verl-cache", processor=model_dir)[0]
    assert "error" not in expected, expected.get("error")
    assert (len(expected["rows"]) < 12) == (limit == 700)  # the filter drops rows with two long videos
    assert_same_batches(_ours(files, model_dir, config, processor=model_dir), expected["batches"])
