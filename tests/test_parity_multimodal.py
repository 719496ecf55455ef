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
from ingest.devtools.oracle import oracle_available, run_verl
from ingest.devtools.samples import IMAGE_KINDS, encode_image, make_image, write_geo3k_parquet
from ingest.errors import find_ingest_error
from ingest.stats import RunLedger
from tests.conftest import collect
from tests.helpers import assert_same_batches, write_media_rows

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
def geo3k_files(tmp_path_factory):
    return write_geo3k_parquet(tmp_path_factory.mktemp("geo3k"), 48, num_files=2, row_group_size=12)


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


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[str(c) for c in CONFIGS])
def test_multimodal_rows_equal_verl(ray_session, geo3k_files, model_dir, oracle_mm, index):
    expected = oracle_mm[index]
    assert "error" not in expected, expected.get("error")
    assert_same_batches(_ours(geo3k_files, model_dir, CONFIGS[index]), expected["batches"])


# pools of size 0: their stage runs in the actors of the stage before it (the actor pools that remain)
_FUSED_LAYOUTS = {
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


def test_parity_data_covers_the_image_kinds(oracle_mm):
    rows = oracle_mm[2]["rows"]
    assert len(rows) > len(oracle_mm[0]["rows"]), "the 640-token filter should drop rows with big images"
    assert any(len(r["multi_modal_data"]["image"]) == 2 for r in rows)
    sizes = [im.size for r in rows for im in r["multi_modal_data"]["image"]]
    assert (28, 28) in sizes and any(w / h > 15 for w, h in sizes) and any(h / w > 15 for w, h in sizes)
    assert "multi_modal_inputs" not in rows[0]
    assert len(IMAGE_KINDS) == 8


def test_gpu_vision_actor_is_schedulable_and_matches_cpu(ray_session, geo3k_files, model_dir):
    assert ray.cluster_resources().get("GPU", 0) >= 1
    config = {**CONFIGS[0], "vision_num_gpus": 0.5, "vision_pool_max_size": 1, "vision_device": "cpu"}
    assert_same_batches(_ours(geo3k_files, model_dir, config), _ours(geo3k_files, model_dir, CONFIGS[0]))


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


def test_only_complete_baseline_jpegs_are_left_to_the_device():
    import random

    from PIL import Image

    from ingest.media.image import decode_rgb, deferrable_jpeg

    rng = random.Random(5)
    jpeg = encode_image(*make_image("jpeg", rng))
    size, info = deferrable_jpeg(jpeg)
    rgb, rgb_info = decode_rgb(jpeg)
    assert size.shape[:2] == rgb.shape[:2] and size.size == 0 and info == rgb_info
    gray = io.BytesIO()
    Image.new("L", (40, 30), 7).save(gray, "JPEG")
    assert deferrable_jpeg(gray.getvalue())[1] == decode_rgb(gray.getvalue())[1]
    progressive, cmyk = io.BytesIO(), io.BytesIO()
    Image.fromarray(rgb).save(progressive, "JPEG", progressive=True)
    Image.new("CMYK", (40, 30)).save(cmyk, "JPEG")
    png = encode_image(*make_image("png", rng))
    # the rest decodes on the CPU in the decode stage, where a truncated file becomes a quarantine record
    assert all(deferrable_jpeg(data) is None for data in (progressive.getvalue(), cmyk.getvalue(), png, jpeg[:-300]))


def _png_chunks(data: bytes) -> list[list[bytes]]:
    """[kind, payload] per chunk of a PNG file."""
    import struct

    chunks, position = [], 8
    while position < len(data):
        (length,) = struct.unpack_from(">I", data, position)
        chunks.append([data[position + 4 : position + 8], data[position + 8 : position + 8 + length]])
        position += 12 + length
    return chunks


def _png_file(chunks: list[list[bytes]]) -> bytes:
    import struct
    import zlib

    body = [struct.pack(">I", len(p)) + k + p + struct.pack(">I", zlib.crc32(k + p)) for k, p in chunks]
    return b"\x89PNG\r\n\x1a\n" + b"".join(body)


def _pil_rgb(data: bytes):
    """What verl gets: PIL's ``convert("RGB")`` pixels and ``info``."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        return np.asarray(rgb), dict(rgb.info)


def test_png_fast_decode_gives_pils_pixels_and_info():
    """8-bit RGB / RGBA PNGs decode with libspng; everything else, and whatever libspng refuses, with PIL. Either
    way the pixels and ``info`` are what PIL's ``convert("RGB")`` gives (what verl gets)."""
    import random

    from PIL import Image

    from ingest.media.image import decode_rgb, plain_png

    rng = random.Random(11)
    buf = io.BytesIO()
    make_image("png", rng)[0].convert("RGB").save(buf, "PNG", dpi=(72, 72))
    rgb = buf.getvalue()
    rgba = encode_image(*make_image("rgba", rng))
    chunks = _png_chunks(rgb)
    text = [b"tEXt", b"comment\x00after the pixels"]
    text_after_pixels = _png_file([*chunks[:-1], text, chunks[-1]])
    unknown_chunk = _png_file([chunks[0], [b"ABCD", b"x"], *chunks[1:]])  # PIL skips it; libspng refuses the file
    gamma = _png_file([chunks[0], [b"gAMA", (45455).to_bytes(4, "big")], *chunks[1:]])  # neither decoder applies it
    deep = encode_image(Image.fromarray(np.full((30, 40), 300, dtype=np.uint16)), "PNG")  # 16-bit gray
    assert plain_png(rgb) and plain_png(rgba) and plain_png(unknown_chunk) and plain_png(gamma)
    assert not plain_png(text_after_pixels) and not plain_png(deep) and not plain_png(rgb[: len(rgb) // 2])
    cases = {"rgb": rgb, "rgba": rgba, "text": text_after_pixels, "unknown": unknown_chunk, "gamma": gamma}
    cases["16-bit"] = deep
    for name, data in cases.items():
        ours, theirs = decode_rgb(data), _pil_rgb(data)
        assert ours[0].dtype == np.uint8 and np.array_equal(ours[0], theirs[0]), name
        assert ours[1] == theirs[1], name
    assert decode_rgb(text_after_pixels)[1]["comment"] == "after the pixels"


def test_png_image_data_inflated_by_libdeflate_decodes_to_pils_pixels():
    """``stored_png``: the image data inflated by libdeflate and stored uncompressed, every other chunk kept, for
    every PNG kind (split image data, text after it included); ``decode_rgb`` then gives PIL's pixels and info.
    Whatever is not sound (a wrong CRC, data that does not inflate to the header's size, interlacing) is left to
    the decoder as it is, so it accepts or rejects it as PIL does."""
    import random
    import struct
    import zlib

    from PIL import Image

    from ingest.media.image import decode_rgb, stored_png

    rng = random.Random(12)
    kinds = {kind: encode_image(*make_image(kind, rng)) for kind in ("png", "gray", "palette", "rgba", "wide")}
    rgb = kinds["png"]
    kinds["16-bit"] = encode_image(Image.fromarray(np.full((30, 41), 300, dtype=np.uint16)), "PNG")
    kinds["1-bit"] = encode_image(Image.fromarray(np.eye(29, dtype=bool)), "PNG")
    chunks = _png_chunks(rgb)
    data = b"".join(p for k, p in chunks if k == b"IDAT")
    thirds = [data[: len(data) // 3], data[len(data) // 3 : 2 * len(data) // 3], data[2 * len(data) // 3 :]]
    kinds["split"] = _png_file([chunks[0], *([b"IDAT", t] for t in thirds), chunks[-1]])
    kinds["text after"] = _png_file([*chunks[:-1], [b"tEXt", b"comment\x00after"], chunks[-1]])
    for name, png in kinds.items():
        stored = stored_png(png)
        assert stored is not None and [k for k, _ in _png_chunks(stored)].count(b"IDAT") == 1, name
        assert [c for c in _png_chunks(stored) if c[0] != b"IDAT"] == [c for c in _png_chunks(png) if c[0] != b"IDAT"]
        ours, theirs = decode_rgb(png), _pil_rgb(png)
        assert np.array_equal(ours[0], theirs[0]) and ours[1] == theirs[1], name
        assert np.array_equal(_pil_rgb(stored)[0], theirs[0]), name
    assert decode_rgb(kinds["text after"])[1]["comment"] == "after"

    idat = next(k for k, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    bad_crc = bytearray(rgb)
    bad_crc[8 + sum(12 + len(p) for _, p in chunks[: idat + 1]) - 1] ^= 1  # the first IDAT chunk's CRC
    flipped = bytearray(chunks[idat][1])
    flipped[len(flipped) // 2] ^= 0x55  # inside the deflate stream, CRC recomputed: inflate or checksum fails
    bad_data = _png_file([*chunks[:idat], [b"IDAT", bytes(flipped)], *chunks[idat + 1 :]])
    short = _png_file([*chunks[:idat], [b"IDAT", zlib.compress(zlib.decompress(data)[:-7])], *chunks[idat + 1 :]])
    interlaced = rgb[:28] + b"\x01" + rgb[29:]
    for name, png in {"crc": bytes(bad_crc), "data": bad_data, "short": short, "interlaced": interlaced}.items():
        assert stored_png(png) is None, name
        try:
            expected = _pil_rgb(png)
        except Exception as error:  # PIL rejects it: so does decode_rgb
            with pytest.raises(type(error)):
                decode_rgb(png)
        else:
            assert np.array_equal(decode_rgb(png)[0], expected[0]), name
    assert struct.unpack_from(">I", stored_png(rgb), 8)[0] == 13  # IHDR first, untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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


# --- the vision pool's pixel ops ------------------------------------------------------------------------------------


def _sample_rgbs() -> list[np.ndarray]:
    import random

    rng = random.Random(3)
    images = [make_image(kind, rng)[0].convert("RGB") for kind in IMAGE_KINDS for _ in range(2)]
    big = np.asarray(make_image("png", rng)[0].convert("RGB").resize((1400, 1100)))  # over the pixel budget
    return [np.asarray(image) for image in images] + [big]


def test_pixel_ops_equal_transformers_image_processor(model_dir):
    """``ImagePixels`` (torch ops, no transformers) gives transformers' Qwen2-VL processor output bit for bit."""
    from transformers import AutoImageProcessor

    from ingest.media.pixels import ImagePixels

    pixels = ImagePixels.from_dir(model_dir)
    assert pixels is not None
    rgbs = _sample_rgbs()
    ours, grids = pixels(rgbs)
    theirs = AutoImageProcessor.from_pretrained(model_dir)(
        images=[torch.from_numpy(rgb.copy()).permute(2, 0, 1) for rgb in rgbs], return_tensors="pt"
    )
    assert np.array_equal(grids, theirs["image_grid_thw"].numpy())
    assert np.array_equal(ours, theirs["pixel_values"].numpy())


def test_compiled_resize_equals_torchs_uint8_kernel(model_dir):
    """``ingest.media._resize`` (the CPU path's resize without torch) gives torch's uint8 antialiased bicubic
    kernel and the
    processor's patch order to the bit: noise, flat colours and sharp edges, shrunk and enlarged, one side only or
    neither, one-pixel and thin images."""
    from ingest.media import pixels as pixel_ops

    assert pixel_ops._resize is not None, "ingest.media._resize was not built: pip install needs a C compiler"
    pixels = pixel_ops.ImagePixels.from_dir(model_dir)
    rng = np.random.default_rng(5)
    shapes = [(1, 1), (28, 28), (56, 84), (3, 500), (500, 3), (2000, 900), (1100, 1400), (28, 901), (4000, 30)]
    shapes += [(int(rng.integers(7, 1300)), int(rng.integers(7, 1300))) for _ in range(40)]
    for k, (h, w) in enumerate(shapes):
        if k % 3 == 0:
            image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        elif k % 3 == 1:
            image = np.broadcast_to(rng.integers(0, 256, 3, dtype=np.uint8), (h, w, 3)).copy()
        else:
            y, x = np.mgrid[0:h, 0:w]
            image = np.stack([x * 7 % 256, y * 3 % 256, (x // 9 + y // 9) % 2 * 255], -1).astype(np.uint8)
        ours, grids = pixels.patches([image])
        assert isinstance(ours, np.ndarray)
        theirs, their_grids = pixels.patches([torch.from_numpy(image).permute(2, 0, 1)])  # a tensor: torch's kernel
        assert np.array_equal(grids, their_grids)
        assert np.array_equal(ours, theirs.numpy()), (h, w)


def test_compiled_normalize_equals_the_numpy_path(model_dir, monkeypatch):
    """The consumer's uint8 patches -> float32 ``pixel_values`` in C (a per-channel table of the numpy path's float32
    ops) is bit-equal to the numpy path: every byte value, one and two frames, no patches at all."""
    from ingest.media import pixels as pixel_ops

    assert pixel_ops._resize is not None, "ingest.media._resize was not built: pip install needs a C compiler"
    mean, std = pixel_ops.ImagePixels.from_dir(model_dir).norm
    every_value = np.arange(4 * 3 * 16 * 16).reshape(4, 3, 16, 16) % 256  # each channel's plane: 0..255
    noise = np.random.default_rng(3).integers(0, 256, (301, 3, 14, 14))
    for values in (every_value, noise, np.zeros((0, 3, 14, 14))):
        values = values.astype(np.uint8)
        for frames in (1, 2):
            compiled = pixel_ops.normalize_patches(values, mean, std, frames).clone()
            with monkeypatch.context() as patch:
                patch.setattr(pixel_ops, "_resize", None)
                plain = pixel_ops.normalize_patches(values, mean, std, frames)
            assert compiled.shape == plain.shape == (len(values), frames * 3 * values.shape[-1] ** 2)
            assert torch.equal(compiled.view(torch.int32), plain.view(torch.int32)), (values.shape, frames)


def test_cpu_path_without_the_compiled_resize_gives_the_same_patches(model_dir, monkeypatch):
    """Where ``ingest.media._resize`` was not built (no C compiler at install), the CPU path runs torch's kernel:
    the same
    patches, and the vision stage's records are byte-equal."""
    from ingest.media import pixels as pixel_ops
    from ingest.stages.vision import VisionStage

    rgbs = _sample_rgbs()
    stage = VisionStage(model_dir, DataConfig(vision_device="cpu"))
    grids = [[list(g)] for g in stage.pixels.patches(rgbs)[1].tolist()]
    compiled = [record.as_py() for record in stage._image_inputs([[rgb] for rgb in rgbs], pa.chunked_array([grids]))[0]]
    monkeypatch.setattr(pixel_ops, "_resize", None)
    patches, _ = stage.pixels.patches(rgbs)
    assert isinstance(patches, torch.Tensor)
    fallback = [record.as_py() for record in stage._image_inputs([[rgb] for rgb in rgbs], pa.chunked_array([grids]))[0]]
    assert fallback == compiled


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


def test_vision_stage_blocks_carry_uint8_patches_that_the_collate_finishes(model_dir):
    """The vision stage's ``pixel_values`` records hold uint8 patches (an eighth of the float32 bytes); the collate
    turns them into exactly the processor's float32 values, per row, on the requested device."""
    from ingest.media.pixels import ImagePixels
    from ingest.rowformat.collate import _media_inputs
    from ingest.stages.vision import VisionStage

    pixels = ImagePixels.from_dir(model_dir)
    rgbs = _sample_rgbs()
    expected, grids = pixels(rgbs)
    rows = [rgbs[:2], None, rgbs[2:]]
    stage = VisionStage(model_dir, DataConfig(vision_device="cpu"))
    per_row = [grids[:2].tolist(), [], grids[2:].tolist()]
    values, image_grids = stage._image_inputs(rows, pa.chunked_array([per_row]))
    record = values[0].as_py()
    assert record["dtype"] == "|u1" and record["shape"][1:] == [3, 14, 14] and record["temporal_patch_size"] == 2
    assert sum(len(values[i].as_py()["data"]) for i in (0, 2)) * 8 == expected.nbytes
    column = pa.chunked_array(
        [pa.StructArray.from_arrays([values, image_grids], names=["pixel_values", "image_grid_thw"])]
    )
    for device in (None, "meta"):
        collated = _media_inputs(column, device)
        assert collated[1] == {}
        if device == "meta":
            assert {t.device.type for row in (0, 2) for t in collated[row].values()} == {"meta"}
            continue
        assert all(t.dtype == torch.float32 for t in (collated[0]["pixel_values"], collated[2]["pixel_values"]))
        together = torch.cat([collated[0]["pixel_values"], collated[2]["pixel_values"]]).numpy()
        assert np.array_equal(together, expected)
        assert np.array_equal(np.concatenate([collated[0]["image_grid_thw"], collated[2]["image_grid_thw"]]), grids)


def test_vision_stage_holds_torch_threads_to_the_actors_cpu_share(model_dir, monkeypatch):
    """Ray gives a 0.5-CPU actor ``OMP_NUM_THREADS=1``; torch imported before that (a worker that preloads torch)
    keeps a pool over every core unless the stage applies it."""
    from ingest.stages.vision import VisionStage

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        VisionStage(model_dir, DataConfig(vision_device="cpu"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_image_blocks_reach_the_consumer_as_single_chunks(ray_session, geo3k_files, model_dir):
    """Decode and vision take whole blocks, so each output block is one Arrow chunk per column: slicing it into
    trainer batches (or the next stage's batches) copies no pixels. With per-call batches smaller than a block, Ray
    Data would concatenate the outputs into a multi-chunk block that every slice first combines (copies)."""
    ds = build_dataset(geo3k_files, model_dir, {"shuffle": False, "vision_batch_size": 4}, processor=model_dir)
    blocks = [ray.get(entry.ref) for bundle in ds.iter_internal_ref_bundles() for entry in bundle.blocks]
    assert sum(b.num_rows for b in blocks) > 0 and max(b.num_rows for b in blocks) > 4  # blocks span several calls
    for block in blocks:
        assert {block.column(name).num_chunks for name in ("multi_modal_data", "multi_modal_inputs")} == {1}


def test_device_resize_path_runs_on_cpu_within_the_stated_tolerance(model_dir):
    """The GPU path's code (float resize passes) run on the CPU: grids equal, pixels within two uint8 levels."""
    from ingest.media.pixels import ImagePixels

    pixels = ImagePixels.from_dir(model_dir)
    rgbs = _sample_rgbs()
    cpu, cpu_grids = pixels(rgbs)
    device_path, device_grids = pixels(rgbs, "cpu", native_uint8=False)
    assert np.array_equal(cpu_grids, device_grids)
    difference = np.abs(cpu - device_path)
    assert difference.max() <= pixels.device_tolerance()
    assert (difference > 1e-4).mean() < 0.01  # off only where a value sits near a rounding edge


def test_block_images_go_to_the_device_in_one_copy(geo3k_files, model_dir):
    """Images that view one buffer become views of one uploaded tensor (one transfer per batch); others, and
    tensors already on the device, go as they are. A decoded block's images are such views."""
    from ingest.blocks import rgb_arrays
    from ingest.devtools.vision_bench import decoded_blocks
    from ingest.media.pixels import _shared_span, device_images

    rgbs = _sample_rgbs()
    buffer = np.concatenate([rgb.reshape(-1) for rgb in rgbs])
    ends = np.cumsum([rgb.size for rgb in rgbs])
    views = [buffer[end - rgb.size : end].reshape(rgb.shape) for rgb, end in zip(rgbs, ends, strict=True)]
    on_device = torch.zeros((3, 5, 7), dtype=torch.uint8)
    uploaded = device_images([*views, on_device], "cpu", one_copy=True)
    assert uploaded[-1] is on_device
    for tensor, rgb in zip(uploaded, rgbs, strict=False):
        assert torch.equal(tensor, torch.from_numpy(rgb).permute(2, 0, 1))
    assert len({t.untyped_storage().data_ptr() for t in uploaded[:-1]}) == 1  # views of one tensor
    separate = device_images([rgb.copy() for rgb in rgbs], "cpu", one_copy=True)
    assert len({t.untyped_storage().data_ptr() for t in separate}) == len(rgbs)
    far_apart = [buffer[:12].reshape(2, 2, 3), buffer[-12:].reshape(2, 2, 3)]
    assert _shared_span(far_apart) is None  # the span would be mostly other bytes: each goes on its own
    block = decoded_blocks(geo3k_files, model_dir)[0]
    assert _shared_span([im for row in rgb_arrays(block.column("multi_modal_data")) if row for im in row])


def test_device_patches_come_back_into_reused_host_buffers(model_dir):
    """A device's patches land in a ``DEVICE_PATCHES`` buffer, page-locked where CUDA is (one DMA back), reused
    once the block is gone; ``pinned_or_pageable`` gives ordinary memory without CUDA. The copy-back itself runs
    with a device: ``test_cuda_vision_matches_cpu_within_tolerance`` and ``tests/gpu``."""
    from ingest.media.pixels import DEVICE_PATCHES, ImagePixels, host_array
    from ingest.memory import pinned_or_pageable

    array = pinned_or_pageable(1000)
    assert array.dtype == np.uint8 and array.shape == (1000,)
    assert torch.from_numpy(array).is_pinned() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        return
    pixels = ImagePixels.from_dir(model_dir)
    patches, _ = pixels.patches(_sample_rgbs(), "cuda")
    host = host_array(patches)
    assert torch.equal(torch.from_numpy(host), patches.cpu()) and torch.from_numpy(host).is_pinned()
    address = host.ctypes.data
    assert any(b.ctypes.data == address for b in DEVICE_PATCHES._buffers)
    assert host_array(patches).ctypes.data != address  # still held: not handed out again
    del host
    assert host_array(patches).ctypes.data == address


def test_other_image_processors_go_through_transformers(model_dir, tmp_path):
    import json
    import shutil

    from transformers import AutoImageProcessor

    from ingest.media.pixels import ImagePixels
    from ingest.stages.vision import VisionStage

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "preprocessor_config.json").read_text())
    (model / "preprocessor_config.json").write_text(json.dumps({**config, "do_normalize": False}))
    assert ImagePixels.from_dir(model) is None
    stage = VisionStage(str(model), DataConfig(vision_device="cpu"))
    rgbs = _sample_rgbs()[:3]
    values, grids = stage.pixel_values(rgbs)
    assert stage.pixels is None
    theirs = AutoImageProcessor.from_pretrained(str(model))(
        images=[torch.from_numpy(rgb.copy()).permute(2, 0, 1) for rgb in rgbs], return_tensors="pt"
    )
    assert np.array_equal(values, theirs["pixel_values"].numpy()) and np.array_equal(grids, theirs["image_grid_thw"])


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
    from ingest.devtools.vision_bench import decoded_blocks, image_count, shared_gpu_pool, time_pool

    blocks = decoded_blocks(geo3k_files, model_dir)
    assert sum(image_count(b) for b in blocks) >= sum(b.num_rows for b in blocks) > 0
    refs = [ray.put(b) for b in blocks]
    timing = time_pool(refs, model_dir, actors=1, num_cpus=0.5, num_gpus=0, device="cpu", passes=2)
    assert timing["seconds"] > 0 and timing["device"] == "cpu" and timing["passes"] == 2
    assert shared_gpu_pool(12)["num_gpus"] == 0.0833  # Ray counts GPU fractions in 1e-4 units: 12 of them fit
    deferred = decoded_blocks(geo3k_files, model_dir, defer_jpeg=True)
    jpegs = [x for b in deferred for row in b.column("_media_deferred_jpeg").to_pylist() if row for x in row if x]
    assert jpegs and all(x[:2] == b"\xff\xd8" for x in jpegs)
