"""Sample-data generators for tests and benchmarks beyond the demo's text rows: geo3k-shaped image rows (HF
``Image()`` structs, every PIL mode verl meets), video rows (files and frame lists), and their images.

Deterministic for a seed. The gsm8k-shaped text rows live in ``ingest.demo`` (the product's embedded dataset).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# --- geo3k-shaped multimodal rows (verl's examples/data_preprocess/geo3k.py layout) ----------------------------------

GEO3K_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)

IMAGE_KINDS = ("png", "jpeg", "gray", "palette", "rgba", "tiny", "wide", "tall")
# the kinds above and a photo over 2,000 px wide (JPEG): the hand-off bench's mixed workload
MIXED_KINDS = (*IMAGE_KINDS, "large")


def make_image(kind: str, rng: random.Random, *, grain: int = 1):
    """A synthetic figure of one kind: (PIL image, format). ``grain``: the background noise (and RGBA's alpha) in
    ``grain`` x ``grain`` pixel squares, the same pixel sizes with far fewer encoded bytes (1: every pixel its own)."""
    import numpy as np
    from PIL import Image, ImageDraw

    def coarse(noise):
        return noise if grain == 1 else noise.repeat(grain, 0).repeat(grain, 1)[:h, :w]

    if kind == "tiny":
        w = h = 28
    elif kind == "wide":
        w, h = rng.randint(600, 900), rng.randint(28, 40)
    elif kind == "tall":
        w, h = rng.randint(28, 40), rng.randint(600, 900)
    elif kind == "large":
        w, h = rng.randint(2000, 2400), rng.randint(160, 320)
    else:
        w, h = rng.randint(64, 800), rng.randint(64, 800)
    cells = (-(-h // grain), -(-w // grain))
    noise = coarse(np.random.default_rng(rng.randint(0, 2**31)).integers(0, 256, (*cells, 3), dtype=np.uint8))
    image = Image.fromarray(noise // 4 + 160)
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0, x1, y1 = rng.randint(0, w), rng.randint(0, h), rng.randint(0, w), rng.randint(0, h)
        draw.line([(x0, y0), (x1, y1)], fill=(rng.randint(0, 255), 0, rng.randint(0, 255)), width=2)
    if kind == "gray":
        return image.convert("L"), "PNG"
    if kind == "palette":
        return image.convert("P", palette=Image.Palette.ADAPTIVE, colors=32), "PNG"
    if kind == "rgba":
        alpha = Image.fromarray(coarse(np.random.default_rng(1).integers(0, 256, cells, dtype=np.uint8)))
        image.putalpha(alpha)
        return image, "PNG"
    return image, ("JPEG" if kind in ("jpeg", "large") else "PNG")


def encode_image(image, fmt: str) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


HF_IMAGE_FEATURES = {
    "data_source": {"dtype": "string", "_type": "Value"},
    "prompt": {
        "feature": {"role": {"dtype": "string", "_type": "Value"}, "content": {"dtype": "string", "_type": "Value"}},
        "_type": "List",
    },
    "images": {"feature": {"_type": "Image"}, "_type": "List"},
    "ability": {"dtype": "string", "_type": "Value"},
    "reward_model": {
        "style": {"dtype": "string", "_type": "Value"},
        "ground_truth": {"dtype": "string", "_type": "Value"},
    },
    "extra_info": {
        "split": {"dtype": "string", "_type": "Value"},
        "index": {"dtype": "int64", "_type": "Value"},
        "answer": {"dtype": "string", "_type": "Value"},
        "question": {"dtype": "string", "_type": "Value"},
    },
}


def geo3k_rows(n: int, *, seed: int = 0, kinds=IMAGE_KINDS, multi_every: int = 5, image_dir: str | None = None):
    """Rows like verl's geo3k preprocessing: ``<image>`` in the prompt, ``images`` as HF ``Image()`` structs.

    Every ``multi_every``-th row has two images; with ``image_dir`` every 7th row's images are stored as files and
    referenced by path (``{"bytes": None, "path": ...}``), as HF datasets does for images loaded from disk.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        count = 2 if multi_every and i % multi_every == multi_every - 1 else 1
        images = []
        for k in range(count):
            image, fmt = make_image(kinds[(i + k) % len(kinds)], rng)
            data = encode_image(image, fmt)
            if image_dir is not None and i % 7 == 3:
                path = Path(image_dir) / f"img-{seed}-{i}-{k}.{fmt.lower()}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                images.append({"bytes": None, "path": str(path)})
            else:
                images.append({"bytes": data, "path": None})
        rows.append(_geo3k_row(i, images, rng))
    return rows


def _geo3k_row(i: int, images: list[dict], rng: random.Random) -> dict:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    problem = "<image>" * len(images) + f"Find x if the angle is {a} and the side is {b}."
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": problem + " " + GEO3K_INSTRUCTION}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": "train", "index": i, "answer": str(a + b), "question": problem},
    }


def geo3k_schema() -> pa.Schema:
    """The geo3k rows' Arrow schema, with the HF ``Image()`` feature metadata (HF datasets, so verl, loads PIL
    images from it)."""
    import json

    image_struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("images", pa.list_(image_struct)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
                ),
            ),
        ],
        metadata={"huggingface": json.dumps({"info": {"features": HF_IMAGE_FEATURES}})},
    )


def write_geo3k_parquet(
    out_dir: str | os.PathLike, num_rows: int, *, num_files: int = 1, seed: int = 0, row_group_size: int = 100, **kw
) -> list[str]:
    """geo3k-shaped Parquet with the HF ``Image()`` feature metadata, so HF datasets (verl) loads PIL images."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = geo3k_rows(num_rows, seed=seed, image_dir=str(out / "images"), **kw)
    schema = geo3k_schema()
    paths, per_file = [], -(-num_rows // num_files)
    for k in range(num_files):
        chunk = rows[k * per_file : (k + 1) * per_file]
        path = out / f"geo3k-{k:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(chunk, schema=schema), path, row_group_size=row_group_size)
        paths.append(str(path))
    return paths


def write_geo3k_struct_parquet(
    out_dir: str | os.PathLike, num_rows: int, *, seed: int = 0, row_group_size: int = 100, **kw
) -> list[str]:
    """geo3k-shaped Parquet whose images are plain ``{bytes, path}`` structs (no HF ``Image()`` metadata), as pandas
    or pyarrow write them: verl opens the bytes itself."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "geo3k-struct-00000.parquet"
    table = pa.Table.from_pylist(geo3k_rows(num_rows, seed=seed, **kw), schema=geo3k_schema().remove_metadata())
    pq.write_table(table, path, row_group_size=row_group_size)
    return [str(path)]


def exif_photo_rows(seed: int = 0) -> list[dict]:
    """geo3k-shaped rows of photos as phones and editors write them: a JPEG of each EXIF Orientation (1-8, so every
    turn and flip), a PNG with an ``eXIf`` chunk (6: a quarter turn), a JPEG whose Orientation is in its XMP only
    (8), and a row with two of them. Each image is wider than tall, so a turn swaps its grid."""
    import io

    from PIL import ExifTags, Image

    rng = random.Random(seed)

    def photo(fmt: str, orientation: int, *, xmp: bool = False) -> dict:
        w, h = rng.randint(180, 320), rng.randint(60, 120)
        image, _ = make_image("png", rng)
        image = image.resize((w, h))
        buf = io.BytesIO()
        if xmp:
            description = f'<rdf:Description tiff:Orientation="{orientation}"/>'
            packet = f'<x:xmpmeta xmlns:x="adobe:ns:meta/">{description}</x:xmpmeta>'
            image.save(buf, format=fmt, quality=90, xmp=packet.encode())
        else:
            exif = Image.Exif()
            exif[ExifTags.Base.Orientation] = orientation
            image.save(buf, format=fmt, exif=exif.tobytes(), **({"quality": 90} if fmt == "JPEG" else {}))
        return {"bytes": buf.getvalue(), "path": None}

    images = [[photo("JPEG", k)] for k in range(1, 9)]
    images += [[photo("PNG", 6)], [photo("JPEG", 8, xmp=True)], [photo("JPEG", 6), photo("PNG", 3)]]
    return [_geo3k_row(i, row_images, rng) for i, row_images in enumerate(images)]


def write_exif_photo_parquet(out_dir: str | os.PathLike, *, image_feature: bool = True) -> str:
    """``exif_photo_rows`` in one Parquet file: with the HF ``Image()`` feature metadata (HF datasets decodes the
    images, turned by their Orientation) or without it (plain ``{bytes, path}`` structs, as pandas or pyarrow write
    them: verl opens the bytes itself)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = geo3k_schema()
    if not image_feature:
        schema = schema.remove_metadata()
    path = out / f"exif-photos-{'image' if image_feature else 'struct'}.parquet"
    pq.write_table(pa.Table.from_pylist(exif_photo_rows(), schema=schema), path, row_group_size=4)
    return str(path)


def write_geo3k_pool_parquet(
    out_dir: str | os.PathLike,
    num_rows: int,
    *,
    pool_size: int = 1500,
    rows_per_file: int = 5000,
    row_group_size: int = 1000,
    grain: int = 8,
    seed: int = 0,
    multi_every: int = 5,
) -> dict:
    """Many geo3k-shaped rows fast: ``pool_size`` distinct images (``make_image``, the 8 kinds in turn, its pixel
    sizes, noise in ``grain``-pixel squares) are encoded once and reused across the rows, each row taking the pool's
    next one or two (every ``multi_every``-th row two), every 7th row's by path (the pool's image written once as a
    file), as ``geo3k_rows`` does. Rows go into files of ``rows_per_file``, written one at a time (the whole data set is
    never in memory). For memory and streaming at scale, where image variety is not what is measured.

    Returns the files and the counts: ``files``, ``rows``, ``images`` (by bytes + by path), ``images_by_path``,
    ``pool_images``, ``rows_per_file``, ``row_group_size``, ``bytes_on_disk`` (the Parquet files and image files)."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pool = [make_image(IMAGE_KINDS[k % len(IMAGE_KINDS)], rng, grain=grain) for k in range(pool_size)]
    pool = [(encode_image(image, fmt), fmt.lower()) for image, fmt in pool]
    pool_paths: dict[int, str] = {}

    def by_path(k: int) -> str:
        if k not in pool_paths:
            path = out / "images" / f"pool-{k}.{pool[k][1]}"
            path.write_bytes(pool[k][0])
            pool_paths[k] = str(path)
        return pool_paths[k]

    schema, files, images, images_by_path, next_image = geo3k_schema(), [], 0, 0, 0
    for start in range(0, num_rows, rows_per_file):
        rows = []
        for i in range(start, min(start + rows_per_file, num_rows)):
            count = 2 if multi_every and i % multi_every == multi_every - 1 else 1
            picks = [(next_image + k) % pool_size for k in range(count)]
            next_image += count
            if i % 7 == 3:
                row_images = [{"bytes": None, "path": by_path(k)} for k in picks]
                images_by_path += count
            else:
                row_images = [{"bytes": pool[k][0], "path": None} for k in picks]
            images += count
            rows.append(_geo3k_row(i, row_images, rng))
        path = out / f"geo3k-{start // rows_per_file:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
        files.append(str(path))
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "files": files,
        "rows": num_rows,
        "images": images,
        "images_by_path": images_by_path,
        "pool_images": pool_size,
        "rows_per_file": rows_per_file,
        "row_group_size": row_group_size,
        "bytes_on_disk": on_disk,
    }


# --- video rows (verl's video dicts: {"video": path} or {"video": [frame paths]}) ------------------------------------

VIDEO_FRAME_KINDS = ("png", "jpeg", "rgba", "gray", "wide")


def make_video_file(
    path: str | os.PathLike, frames: int, width: int, height: int, fps: int, seed: int = 0, faststart: bool = False
) -> str:
    """A small MPEG-4 clip (PyAV): a textured frame drifting sideways, so every frame differs. ``faststart``: the
    index (``moov``) before the frames, so a file cut short still reads as whole from its header."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 2 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def _frame_list(out: Path, i: int, rng: random.Random) -> list[str]:
    kind = VIDEO_FRAME_KINDS[i % len(VIDEO_FRAME_KINDS)]
    count = rng.randint(1, 7)  # odd counts: verl pads to an even count with the last frame
    image, fmt = make_image("wide" if kind == "wide" else "png", rng)
    image = image.convert("RGB").resize((max(28, image.width // 3), max(28, image.height // 3)))
    paths = []
    for k in range(count):
        frame = image.rotate(3 * k)
        if kind == "rgba":
            frame = frame.convert("RGBA")
            frame.putalpha(128 + 16 * k)
        elif kind == "gray":
            frame = frame.convert("L")
        path = out / f"frame-{i}-{k}.{'jpg' if kind == 'jpeg' else 'png'}"
        frame.save(path, format="JPEG" if kind == "jpeg" else "PNG")
        paths.append(str(path))
    return paths


def write_video_parquet(
    out_dir: str | os.PathLike,
    num_rows: int,
    *,
    kind: str = "frames",
    with_images: bool = False,
    seed: int = 0,
    row_group_size: int = 8,
) -> list[str]:
    """Rows with ``<video>`` prompts; ``kind="frames"``: frame-image lists, ``"file"``: MPEG-4 clips (PyAV).

    Every 4th row has two videos. ``with_images``: every row also has an ``<image>`` (HF ``Image()`` column; no
    nulls: verl 0.5.0's overlong filter fails on a null image list, and without the filter it keeps the null
    ``images`` key in that row only).
    """
    import json

    out = Path(out_dir)
    (out / "media").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        videos = []
        for k in range(2 if i % 4 == 3 else 1):
            if kind == "frames":
                videos.append({"video": _frame_list(out / "media", 10 * i + k, rng)})
            else:
                w, h = rng.choice([(96, 64), (64, 96), (160, 96), (64, 64), (192, 128)])  # decord needs width % 32 == 0
                path = out / "media" / f"clip-{i}-{k}.mp4"
                make_video_file(path, rng.randint(6, 40), w, h, rng.choice([5, 10, 24, 30]), seed=10 * i + k)
                videos.append({"video": str(path)})
        images = None
        text = "<video>" * len(videos) + f"What changes in clip {i}?"
        if with_images:
            image, fmt = make_image(IMAGE_KINDS[i % len(IMAGE_KINDS)], rng)
            images = [{"bytes": encode_image(image, fmt), "path": None}]
            text = "<image>Compare with this figure. " + text
        row = {"prompt": [{"role": "user", "content": text}], "images": images, "videos": videos}
        rows.append({**row, "extra_info": {"index": i}})
    source = pa.list_(pa.string()) if kind == "frames" else pa.string()
    value = {"dtype": "string", "_type": "Value"}
    features = {
        "prompt": {"feature": {"role": value, "content": value}, "_type": "List"},
        "images": {"feature": {"_type": "Image"}, "_type": "List"},
        "videos": {
            "feature": {"video": {"feature": value, "_type": "List"} if kind == "frames" else value},
            "_type": "List",
        },
        "extra_info": {"index": {"dtype": "int64", "_type": "Value"}},
    }
    fields = [
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("videos", pa.list_(pa.struct([("video", source)]))),
        ("extra_info", pa.struct([("index", pa.int64())])),
    ]
    if not with_images:
        fields.pop(1)
        features.pop("images")
    schema = pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})
    path = out / f"video-{kind}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
    return [str(path)]


# Qwen2.5-VL's published processor settings beside Qwen2-VL's (Qwen/Qwen2.5-VL-*-Instruct preprocessor_config.json):
# the same patch / merge / temporal sizes and CLIP mean / std, its own class and a larger pixel budget
QWEN25_VL_PIXELS = {"shortest_edge": 3136, "longest_edge": 12845056}


def qwen25_vl_model_dir(out_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> str:
    """A Qwen2.5-VL processor directory built offline: the embedded vocabulary and chat template (``base``: the
    embedded Qwen2-VL directory) with Qwen2.5-VL's processor class and pixel budget."""
    import json
    import shutil

    from ingest.tokenizer.offline import build_offline_model_dir

    out = Path(out_dir)
    if (out / "preprocessor_config.json").is_file():
        return str(out)
    shutil.copytree(base or build_offline_model_dir(), out, dirs_exist_ok=True)
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = out / name
        if not path.is_file():  # transformers 4 writes no processor_config.json (its sections are files of their own)
            continue
        config = json.loads(path.read_text())
        config["processor_class"] = "Qwen2_5_VLProcessor"
        image = config.get("image_processor", config) if name == "processor_config.json" else config
        if "size" in image:
            image["size"] = dict(QWEN25_VL_PIXELS)
        path.write_text(json.dumps(config, indent=2))
    return str(out)


# Qwen3-VL's published processor settings (Qwen/Qwen3-VL-* preprocessor_config.json, video_preprocessor_config.json)
QWEN3_VL_IMAGE = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
QWEN3_VL_VIDEO = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "do_sample_frames": True,
}


def qwen3_vl_model_dir(out_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> str:
    """A Qwen3-VL processor directory built offline: the embedded vocabulary and chat template with Qwen3-VL's
    processor class, patch size 16, pixel budgets and mean / std."""
    import json
    import shutil

    from ingest.tokenizer.offline import build_offline_model_dir

    out = Path(out_dir)
    if (out / "preprocessor_config.json").is_file():
        return str(out)
    shutil.copytree(base or build_offline_model_dir(), out, dirs_exist_ok=True)

    def update(name: str, changes: dict, section: str | None = None) -> None:
        if not (out / name).is_file():  # transformers 4 writes no processor_config.json
            return
        config = json.loads((out / name).read_text())
        (config.setdefault(section, {}) if section else config).update(changes)
        config["processor_class"] = "Qwen3VLProcessor"
        (out / name).write_text(json.dumps(config, indent=2))

    update("preprocessor_config.json", QWEN3_VL_IMAGE)
    update("video_preprocessor_config.json", QWEN3_VL_VIDEO)
    update("processor_config.json", QWEN3_VL_IMAGE, "image_processor")
    update("processor_config.json", QWEN3_VL_VIDEO, "video_processor")
    update("tokenizer_config.json", {})
    return str(out)


# the model type and class a rollout's config.json names per processor family: verl's rollout reads the model type
# (its continuous-token builder, the processor's rope index) from the model folder's config.json
MODEL_CONFIGS = {
    "qwen2-vl": {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]},
    "qwen2.5-vl": {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"]},
    "qwen3-vl": {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"]},
}


def rollout_model_dir(out_dir: str | os.PathLike, processor_dir: str | os.PathLike, family: str = "qwen2-vl") -> str:
    """A processor directory with the ``config.json`` of its family (no weights): what verl's rollout loads as its
    model folder (``actor_rollout_ref.model.path``); the config's other fields keep transformers' defaults."""
    import json
    import shutil

    out = Path(out_dir)
    if not (out / "config.json").is_file():
        shutil.copytree(processor_dir, out, dirs_exist_ok=True)
        (out / "config.json").write_text(json.dumps(MODEL_CONFIGS[family], indent=2))
    return str(out)
