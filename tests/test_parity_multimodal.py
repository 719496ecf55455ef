"""Multimodal parity with verl 0.5.0 (geo3k-shaped data written with the HF Image() feature), bad media, GPU wiring."""

from __future__ import annotations

import io
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from ingest import BadRowError, build_dataset
from ingest.config import DataConfig, StageContext
from ingest.errors import find_ingest_error
from ingest.stats import RunLedger
from tests.support.batches import collect
from tests.support.compare import assert_same_batches
from tests.support.media import write_media_rows
from tests.support.tiers import first_in_matrix, slow
from tools.oracle import oracle_available, run_verl
from tools.samples import IMAGE_KINDS, encode_image, make_image

CONFIGS = [
    {"truncation": "left", "filter_overlong_prompts": True, "return_raw_chat": True, "max_prompt_length": 640},
    {"truncation": "right", "filter_overlong_prompts": True, "return_full_prompt": True, "max_prompt_length": 1536},
    {
        "truncation": "left",
        "filter_overlong_prompts": True,
        "return_multi_modal_inputs": False,
        "max_prompt_length": 2048,
    },
]
BATCH = 8


@pytest.fixture(scope="module")
def oracle_mm(geo3k_files, model_dir, tmp_path_factory):
    if not oracle_available():
        pytest.skip("verl 0.5.0 oracle not installed (make oracle)")
    cache = str(tmp_path_factory.mktemp("verl-cache"))
    configs = [{**c, "cache_dir": cache} for c in CONFIGS]
    runs = run_verl("rows", geo3k_files, model_dir, None, configs=configs, batch_size=BATCH, processor=model_dir)
    return runs["runs"]


def _ours(files, model_dir, config, **extra):
    return collect(build_dataset(files, model_dir, {**config, "shuffle": False, **extra}, processor=model_dir), BATCH)


@slow
@pytest.mark.parametrize("index", first_in_matrix(range(len(CONFIGS)), ids=[str(c) for c in CONFIGS]))
def test_multimodal_rows_equal_verl(ray_session, geo3k_files, model_dir, oracle_mm, index):
    expected = oracle_mm[index]
    assert "error" not in expected, expected.get("error")
    assert_same_batches(_ours(geo3k_files, model_dir, CONFIGS[index]), expected["batches"])


# pools of size 0: their stage runs in the actors of the stage before it (the actor pools that remain); the test
# session's 4-CPU cluster lays unset sizes out as one pool, so the three pools are named here
_FUSED_LAYOUTS = {
    "three pools": (
        {"decode_pool_max_size": 1, "vision_pool_max_size": 1},
        ["TokenizeActor", "DecodeActor", "VisionActor"],
    ),
    "decode in the tokenizer actors": ({"decode_pool_max_size": 0}, ["TokenizeActor", "VisionActor"]),
    "decode and vision in the tokenizer actors": (
        {"decode_pool_max_size": 0, "vision_pool_max_size": 0},
        ["TokenizeActor"],
    ),
    "vision in the decode actors": (
        {"decode_pool_max_size": 1, "vision_pool_max_size": 0},
        ["TokenizeActor", "DecodeActor"],
    ),
}


@slow
@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
def test_stages_in_fewer_pools_equal_verl(ray_session, geo3k_files, model_dir, oracle_mm, layout):
    """``decode_pool_max_size`` / ``vision_pool_max_size`` 0: the same stages in fewer processes; verl's rows."""
    expected = oracle_mm[0]
    assert "error" not in expected, expected.get("error")
    pools, actors = _FUSED_LAYOUTS[layout]
    config = {**CONFIGS[0], "shuffle": False, **pools}
    ds = build_dataset(geo3k_files, model_dir, config, processor=model_dir)
    operators = [op.name for op in ds._logical_plan.dag.post_order_iter()]
    assert [name.removeprefix("MapBatches(")[:-1] for name in operators[1:]] == actors
    assert_same_batches(collect(ds, BATCH), expected["batches"])


@slow
def test_parity_data_covers_the_image_kinds(oracle_mm):
    rows = oracle_mm[2]["rows"]
    assert len(rows) > len(oracle_mm[0]["rows"]), "the 640-token filter should drop rows with big images"
    assert any(len(r["multi_modal_data"]["image"]) == 2 for r in rows)
    sizes = [im.size for r in rows for im in r["multi_modal_data"]["image"]]
    assert (28, 28) in sizes and any(w / h > 15 for w, h in sizes) and any(h / w > 15 for w, h in sizes)
    assert "multi_modal_inputs" not in rows[0]
    assert len(IMAGE_KINDS) == 8


@slow
def test_gpu_vision_actor_is_schedulable_and_matches_cpu(ray_session, geo3k_files, model_dir):
    assert ray.cluster_resources().get("GPU", 0) >= 1
    config = {**CONFIGS[0], "vision_num_gpus": 0.5, "vision_pool_max_size": 1, "vision_device": "cpu"}
    assert_same_batches(_ours(geo3k_files, model_dir, config), _ours(geo3k_files, model_dir, CONFIGS[0]))


@slow
def test_jpegs_decoded_by_the_vision_actor_equal_verl(ray_session, geo3k_files, model_dir, oracle_mm):
    """``vision_decode_jpeg_on_device``: baseline JPEGs skip the decode stage and are decoded in the (GPU-scheduled)
    vision actor on its device (torchvision's nvJPEG on cuda); on the CPU that is PIL: verl's rows."""
    expected = oracle_mm[0]
    assert "error" not in expected, expected.get("error")
    config = {"vision_num_gpus": 0.5, "vision_pool_max_size": 1, "vision_device": "cpu"}
    ours = _ours(geo3k_files, model_dir, CONFIGS[0], vision_decode_jpeg_on_device=True, **config)
    assert_same_batches(ours, expected["batches"])


def test_deferred_jpegs_give_the_same_block_as_the_decode_stage(geo3k_files, model_dir):
    """In-process: the decode stage leaves the JPEGs encoded (and only those), the vision stage decodes them; the
    output block equals the one of the CPU decode stage, byte for byte (pixels, info, patches)."""
    from actors.tokenize import TokenizeActor
    from ingest.blocks import DEFERRED_JPEG_COLUMN
    from ingest.config import DataConfig
    from ingest.datasets.plan import plan_input
    from ingest.read.files import unify_schemas
    from ingest.read.units import read_unit
    from ingest.stages.decode import DecodeStage
    from ingest.stages.vision import VisionStage

    cfg = DataConfig.from_any({**CONFIGS[2], "max_prompt_length": 4096})
    plan = plan_input(geo3k_files, cfg, multimodal=True)
    schema = unify_schemas(plan.infos)
    tokenize = TokenizeActor(cfg, StageContext(geo3k_files), model_dir, model_dir)
    vision = VisionStage(model_dir, DataConfig(vision_device="cpu"))
    deferred = 0
    for unit in plan.units:
        for table in tokenize(read_unit(unit, plan.files[unit.file_index], schema, {}, None)):
            table = table.slice(1)  # a block that is a slice, as Ray Data may hand one over
            left = DecodeStage(DataConfig(vision_decode_jpeg_on_device=True))(table).table
            jpegs = [x for row in left.column(DEFERRED_JPEG_COLUMN).to_pylist() if row for x in row if x is not None]
            assert all(x[:2] == b"\xff\xd8" for x in jpegs)
            deferred += len(jpegs)
            assert vision(left).equals(vision(DecodeStage(DataConfig(on_bad_row="raise"))(table).table))
    assert deferred >= 3


@pytest.mark.gpu
def test_cuda_jpeg_decode_is_close_to_pil(ray_session, geo3k_files, model_dir):
    """nvJPEG (torchvision on cuda) against PIL's libjpeg-turbo (a different IDCT and chroma upsampling): the grids
    and ids equal, the pixels close. Measured on an H200 (torch 2.11, torchvision 0.26, 2026-11-26): 7 of the JPEGs
    differ, by 3.3-3.9 levels on average per image and 74 at most (sharp colour edges); the bounds leave a margin."""
    gpu_config = {"vision_num_gpus": 1, "vision_device": "cuda", "vision_decode_jpeg_on_device": True}
    gpu = _ours(geo3k_files, model_dir, {**CONFIGS[0], **gpu_config})
    cpu = _ours(geo3k_files, model_dir, CONFIGS[0])
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
        for x, y in zip(a["multi_modal_data"], b["multi_modal_data"], strict=True):
            for p, q in zip(x["image"], y["image"], strict=True):
                assert p.size == q.size and p.mode == q.mode == "RGB"
                difference = np.abs(np.asarray(p, dtype=np.int16) - np.asarray(q, dtype=np.int16))
                assert difference.mean() < 6 and difference.max() <= 96
        for x, y in zip(a["multi_modal_inputs"], b["multi_modal_inputs"], strict=True):
            assert torch.equal(x["image_grid_thw"], y["image_grid_thw"])
            assert (x["pixel_values"] - y["pixel_values"]).abs().mean() < 0.1  # ~7 levels / std


@pytest.mark.gpu
@pytest.mark.parametrize("device_resize", ["torch", "triton"])
def test_cuda_vision_matches_cpu_within_tolerance(ray_session, geo3k_files, model_dir, device_resize):
    from ingest.media.pixels import ImagePixels

    pixels = ImagePixels.from_dir(model_dir)
    gpu_config = {**CONFIGS[0], "vision_num_gpus": 1, "vision_device": "cuda", "vision_device_resize": device_resize}
    gpu = _ours(geo3k_files, model_dir, gpu_config)
    cpu = _ours(geo3k_files, model_dir, CONFIGS[0])
    differing = total = 0
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"], b["position_ids"])
        for x, y in zip(a["multi_modal_inputs"], b["multi_modal_inputs"], strict=True):
            assert torch.equal(x["image_grid_thw"], y["image_grid_thw"])
            difference = (x["pixel_values"] - y["pixel_values"]).abs()
            if device_resize == "triton":  # the uint8 kernel's weights and integer sums: its bytes exactly
                assert torch.equal(x["pixel_values"], y["pixel_values"])
            # torch's float passes (no uint8 kernel on the device): at most two uint8 levels off the CPU kernel, in
            # ~0.6% of the values (one image of the H100's run in 2026-11 had 1.05%, so the share is over all images)
            assert difference.max() <= pixels.device_tolerance()
            differing, total = differing + int((difference > 1e-4).sum()), total + difference.numel()
    assert differing / total < 0.01


# --- the vision pool ------------------------------------------------------------------------------------------------


def test_cpu_vision_actor_runs_without_importing_torch(ray_session, model_dir):
    """Decode and the CPU vision stage (``vision_device: auto`` in an actor Ray gave no GPU) never import torch:
    seconds of each actor's start-up. Checked in a new worker process (its own runtime env)."""

    @ray.remote(num_cpus=0.5, runtime_env={"env_vars": {"INGEST_TEST_FRESH_WORKER": "1"}})
    class Probe:
        def run(self, model: str) -> tuple[str, bool, bool]:
            from PIL import Image

            from ingest.media.geometry import VisionSpec, image_grid
            from ingest.media.image import decode_rgb
            from ingest.stages.vision import VisionStage

            fresh = "torch" not in sys.modules
            buffer = io.BytesIO()
            Image.new("RGB", (300, 200), (10, 200, 30)).save(buffer, format="PNG")
            stage = VisionStage(model, DataConfig(vision_device="auto"))
            grid = list(image_grid(300, 200, VisionSpec.from_dir(model)))
            values, _ = stage._image_inputs([[decode_rgb(buffer.getvalue())[0]]], pa.chunked_array([[[grid]]]))
            assert values[0].as_py()["shape"][0] == grid[1] * grid[2]
            return stage.device, fresh, "torch" in sys.modules

    probe = Probe.remote()
    try:
        assert ray.get(probe.run.remote(str(model_dir)), timeout=120) == ("cpu", True, False)
    finally:
        ray.kill(probe)


def test_image_blocks_reach_the_consumer_as_single_chunks(ray_session, geo3k_files, model_dir):
    """Decode and vision take whole blocks, so each output block is one Arrow chunk per column: slicing it into
    trainer batches (or the next stage's batches) copies no pixels. With per-call batches smaller than a block, Ray
    Data would concatenate the outputs into a multi-chunk block that every slice first combines (copies)."""
    ds = build_dataset(geo3k_files, model_dir, {"shuffle": False, "vision_batch_size": 4}, processor=model_dir)
    # a bundle's entries: (ref, metadata) pairs in Ray 2.48, objects with .ref in 2.60
    refs = [
        getattr(entry, "ref", None) or entry[0] for bundle in ds.iter_internal_ref_bundles() for entry in bundle.blocks
    ]
    blocks = ray.get(refs)
    assert sum(b.num_rows for b in blocks) > 0 and max(b.num_rows for b in blocks) > 4  # blocks span several calls
    for block in blocks:
        assert {block.column(name).num_chunks for name in ("multi_modal_data", "multi_modal_inputs")} == {1}


# --- bad media -----------------------------------------------------------------------------------------------------


def _png(kind="png", seed=0):
    import random

    return encode_image(*make_image(kind, random.Random(seed)))


def _bad_media_file(path):
    good = {"bytes": _png(), "path": None}
    rows = [
        ("<image>fine", [good]),
        ("<image>corrupt", [{"bytes": b"\x89PNG\r\n\x1a\n not really", "path": None}]),
        ("<image>missing file", [{"bytes": None, "path": "/no/such/image.png"}]),
        ("<image>zero size", [{"bytes": b"", "path": None}]),
        ("<image><image>two placeholders, one image", [good]),
        ("no placeholder", [good]),
        ("<image>fine again", [good]),
    ]
    return write_media_rows(path, rows)


def test_bad_media_is_quarantined_and_counted(ray_session, model_dir, tmp_path):
    path = _bad_media_file(tmp_path / "bad.parquet")
    ledger = RunLedger.remote()
    ds = build_dataset(path, model_dir, {"shuffle": False}, processor=model_dir, ledger=ledger)
    batches = collect(ds)
    assert [int(i) for b in batches for i in b["index"]] == [0, 6]
    counts = ray.get(ledger.get.remote())
    assert counts["rows_in"] == 7 and counts["quarantined"] == 5
    assert counts["rows_in"] == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]
    records = ray.get(ledger.quarantine.remote())
    assert [r["row"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["file"] == path and r["column"] == "images" for r in records)
    reasons = [r["reason"] for r in records]
    assert "bad image" in reasons[0] and "/no/such/image.png" in reasons[1] and "neither bytes" in reasons[2]
    assert reasons[3] == "2 <image> placeholders for 1 images" and reasons[4] == "0 <image> placeholders for 1 images"
    assert '"content": "<image>corrupt"' in records[0]["original"]


def _truncated_through_media_file(path):
    """Image rows over a 160-token limit: one with a long text after the image (right truncation cuts text only), one
    whose image alone is over the limit (any truncation cuts its image tokens), one under the limit."""
    from PIL import Image

    def jpeg(width: int, height: int) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(np.full((height, width, 3), 90, dtype=np.uint8)).save(buffer, format="JPEG")
        return buffer.getvalue()

    small, large = {"bytes": jpeg(56, 56), "path": None}, {"bytes": jpeg(448, 448), "path": None}  # 4 and 256 tokens
    rows = [
        ("<image>" + " and then some more words" * 40, [small]),
        ("<image>what is this?", [large]),
        ("<image>fine", [small]),
    ]
    import json

    from tools.samples import HF_IMAGE_FEATURES

    table = pq.read_table(write_media_rows(path, rows))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = table.set_column(1, "images", table.column("images").cast(pa.list_(image)))
    features = {"prompt": HF_IMAGE_FEATURES["prompt"], "images": HF_IMAGE_FEATURES["images"]}
    features["extra_info"] = {"index": {"dtype": "int64", "_type": "Value"}}
    # HF datasets' Image() feature: verl (the oracle) then loads PIL images from the structs
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}), path)
    return str(path)


TRUNCATING = {"shuffle": False, "filter_overlong_prompts": False, "max_prompt_length": 160, "truncation": "right"}


@slow
def test_truncation_that_cuts_image_tokens_is_a_bad_row(ray_session, model_dir, tmp_path):
    """verl truncates a prompt through its image tokens and then fails in its rope index; here that row is quarantined
    (or raised) with its reason, and a row whose truncation cuts only text is kept with every image token."""
    path = _truncated_through_media_file(tmp_path / "cut.parquet")
    ledger = RunLedger.remote()
    batches = collect(build_dataset(path, model_dir, TRUNCATING, processor=model_dir, ledger=ledger))
    assert [int(i) for b in batches for i in b["index"]] == [0, 2]
    from ingest.tokenizer.chat import ChatTokenizer

    image_pad = ChatTokenizer(model_dir).token_id("<|image_pad|>")
    first = batches[0]
    assert int(first["attention_mask"][0].sum()) == 160  # truncated to the limit, every image token kept
    tokens = int(first["multi_modal_inputs"][0]["image_grid_thw"].prod()) // 4
    assert tokens == 4 and int((first["input_ids"][0] == image_pad).sum()) == tokens
    counts = ray.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (3, 2, 1)
    [record] = ray.get(ledger.quarantine.remote())
    assert (record["file"], record["row"], record["column"]) == (path, 1, "images")
    assert record["reason"].startswith("truncation='right' to max_prompt_length=160 cuts into the image / video tokens")
    with pytest.raises(BadRowError) as info:
        collect(build_dataset(path, model_dir, {**TRUNCATING, "on_bad_row": "raise"}, processor=model_dir))
    assert (find_ingest_error(info.value).file, find_ingest_error(info.value).row) == (path, 1)
    if oracle_available():  # what verl 0.5.0 does with the same rows: the row cut through its image fails its loader
        verl = run_verl("rows", [path], model_dir, None, configs=[TRUNCATING], batch_size=4, processor=model_dir)
        assert "RuntimeError: shape mismatch" in verl["runs"][0]["error"]


def test_raw_bytes_column_decodes_like_pil(ray_session, model_dir, tmp_path):
    """Raw bytes (no HF struct) crash verl 0.5.0; here they give the PIL image verl gets from an Image() feature."""
    from PIL import Image

    data = _png("palette", 3)
    table = pa.table(
        {"prompt": [[{"role": "user", "content": "<image>x"}]], "images": pa.array([[data]], pa.list_(pa.binary()))}
    )
    pq.write_table(table, tmp_path / "raw.parquet")
    batch = collect(build_dataset(str(tmp_path / "raw.parquet"), model_dir, {"shuffle": False}, processor=model_dir))[0]
    ours = batch["multi_modal_data"][0]["image"][0]
    expected = Image.open(io.BytesIO(data)).convert("RGB")
    assert ours == expected and np.array_equal(np.asarray(ours), np.asarray(expected))


def _truncated_media_file(path):
    """Media whose headers read (so the tokenize stage plans them) but whose data do not decode."""
    png = _png()
    rows = [
        ("<image>fine", [{"bytes": png, "path": None}]),
        ("<image>truncated", [{"bytes": png[: len(png) // 2], "path": None}]),
        ("<image><image>second one truncated", [{"bytes": png, "path": None}, {"bytes": png[:200], "path": None}]),
        ("<image>fine again", [{"bytes": png, "path": None}]),
    ]
    return write_media_rows(path, rows)


def _broken_jpeg_file(path):
    """JPEGs complete to their end marker, so that with ``vision_decode_jpeg_on_device`` the decode stage leaves them to
    the vision actor, where neither torchvision nor PIL decodes them (a stray start-of-image marker mid-scan)."""
    jpeg, png = _png("jpeg"), _png()
    broken = jpeg[: len(jpeg) // 2] + b"\xff\xd8\x00\x04\x00\x00" + jpeg[len(jpeg) // 2 :]
    rows = [
        ("<image>fine", [{"bytes": jpeg, "path": None}]),
        ("<image>broken", [{"bytes": broken, "path": None}]),
        ("<image><image>a png, then a broken jpeg", [{"bytes": png, "path": None}, {"bytes": broken, "path": None}]),
        ("<image>fine again", [{"bytes": jpeg, "path": None}]),
    ]
    return write_media_rows(path, rows)


_CPU_KERNELS = {"vision_device": "cpu"}
# where media that fail to decode are caught: the decode pool, the tokenizer actors (decode_pool_max_size 0), or for
# JPEGs left to the device decoder, the (GPU-scheduled; kernels on the CPU here) vision actor
_DECODE_PLACES = {
    "decode pool": (_truncated_media_file, {"decode_pool_max_size": 1}),
    "decode in tokenizer actors": (_truncated_media_file, {"decode_pool_max_size": 0}),
    "decode and vision in tokenizer actors": (
        _truncated_media_file,
        {"decode_pool_max_size": 0, "vision_pool_max_size": 0},
    ),
    "jpeg decode in the vision actor": (
        _broken_jpeg_file,
        {"vision_decode_jpeg_on_device": True, "vision_num_gpus": 0.5, "vision_pool_max_size": 1, **_CPU_KERNELS},
    ),
}


@slow
@pytest.mark.parametrize("place", list(_DECODE_PLACES))
def test_media_that_fails_to_decode_is_quarantined_and_counted(ray_session, model_dir, tmp_path, place):
    make, extra = _DECODE_PLACES[place]
    path = make(tmp_path / "undecodable.parquet")
    ledger = RunLedger.remote()
    config = {"shuffle": False, **extra}
    ds = build_dataset(path, model_dir, config, processor=model_dir, ledger=ledger)
    batches = collect(ds)
    assert [int(i) for b in batches for i in b["index"]] == [0, 3]
    assert not any(name.startswith("_") for name in batches[0])  # provenance and token counts do not leak
    counts = ray.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (4, 2, 2)
    tokens = sum(int(m.sum()) for b in batches for m in b["attention_mask"])  # max_prompt_length: none truncated
    assert counts["prompt_tokens"] == tokens
    records = ray.get(ledger.quarantine.remote())
    assert [(r["file"], r["row"], r["column"]) for r in records] == [(path, 1, "images"), (path, 2, "images")]
    assert all(r["reason"].startswith("bad image: ") for r in records)
    assert '"index": 2' in records[1]["original"]


@slow
@pytest.mark.parametrize("kind", ["bad header or file", *_DECODE_PLACES])
def test_bad_media_strict_raises_naming_file_and_row(ray_session, model_dir, tmp_path, kind):
    # row 1 is bad in every file: caught by the tokenize stage (header) or where the pixels are decoded
    make, extra = (_bad_media_file, {}) if kind == "bad header or file" else _DECODE_PLACES[kind]
    path = make(tmp_path / "bad.parquet")
    config = {"shuffle": False, "on_bad_row": "raise", **extra}
    with pytest.raises(BadRowError) as info:
        collect(build_dataset(path, model_dir, config, processor=model_dir))
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column) == (path, 1, "images") and err.reason.startswith("bad image: ")


def test_vision_bench_pieces_run_the_vision_stage(ray_session, geo3k_files, model_dir):
    """``bench vision``'s blocks are the decode stage's output and its pool runs ``VisionStage`` on them (a smoke
    test of the command's parts on the session's Ray: no timing asserted)."""
    from tools.vision_bench import decoded_blocks, image_count, shared_gpu_pool, time_pool

    blocks = decoded_blocks(geo3k_files, model_dir)
    assert sum(image_count(b) for b in blocks) >= sum(b.num_rows for b in blocks) > 0
    refs = [ray.put(b) for b in blocks]
    timing = time_pool(refs, model_dir, actors=1, num_cpus=0.5, num_gpus=0, device="cpu", passes=2)
    assert timing["seconds"] > 0 and timing["device"] == "cpu" and timing["passes"] == 2
    assert shared_gpu_pool(12)["num_gpus"] == 0.0833  # Ray counts GPU fractions in 1e-4 units: 12 of them fit
    deferred = decoded_blocks(geo3k_files, model_dir, defer_jpeg=True)
    jpegs = [x for b in deferred for row in b.column("_media_deferred_jpeg").to_pylist() if row for x in row if x]
    assert jpegs and all(x[:2] == b"\xff\xd8" for x in jpegs)


@slow
def test_qwen25_vl_rows_equal_verl(ray_session, geo3k_files, model_dir, tmp_path_factory):
    """A Qwen2.5-VL processor (built offline: the embedded vocabulary, Qwen2.5-VL's class and pixel budget): verl
    0.5.0 takes its Qwen2-VL rope branch; every key equal, large images kept larger than Qwen2-VL's budget allows."""
    from tools.samples import qwen25_vl_model_dir

    if not oracle_available():
        pytest.skip("verl 0.5.0 oracle not installed (make oracle)")
    model = qwen25_vl_model_dir(tmp_path_factory.mktemp("qwen25-vl"), model_dir)
    config = {**CONFIGS[1], "cache_dir": str(tmp_path_factory.mktemp("verl-cache"))}
    expected = run_verl("rows", geo3k_files, model, None, configs=[config], batch_size=BATCH, processor=model)
    expected = expected["runs"][0]
    assert "error" not in expected, expected.get("error")
    assert_same_batches(_ours(geo3k_files, model, CONFIGS[1]), expected["batches"])
