"""Photos with an EXIF Orientation, as phones write them: verl gets an HF ``Image()`` column's images turned by it
(HF datasets' decode applies ``ImageOps.exif_transpose``), and opens a plain ``{bytes, path}`` struct's bytes itself,
unturned (verl 0.6.1 then resizes them with qwen-vl-utils' ``fetch_image``); verl 0.5.0 fails on plain structs, and
ours gives it what the ``Image()`` column gives. Each row format against its own verl release, in both column kinds:
pixels, grids, position ids and (verl 0.9) the rollout's items."""

from __future__ import annotations

import io

import pytest

from ingest.config import datasets_turns_images
from ingest.media.image import decode_rgb, image_size
from tests.support import formats
from tests.support.compare import assert_same_batches
from tools.oracle import oracle_available
from tools.samples import exif_photo_rows, write_exif_photo_parquet

ROW_FORMATS = ["verl-0.5", "verl-0.6", "verl-0.7", "verl-0.9"]
CONFIG = {"filter_overlong_prompts": True, "max_prompt_length": 4096}
BATCH = 4


CASES = [(row_format, kind) for row_format in ROW_FORMATS for kind in ("Image() column", "plain struct")]


@pytest.mark.parametrize(("row_format", "kind"), CASES, ids=[" ".join(case) for case in CASES])
def test_photos_with_an_orientation_reach_the_model_as_verl_gets_them(
    ray_session, model_dir, tmp_path, row_format, kind
):
    if not oracle_available(row_format):
        pytest.skip(f"the {row_format} oracle is not installed (make oracle)")
    formats.skip_unless_formats_allowed(row_format)
    image_feature = kind == "Image() column"
    path = write_exif_photo_parquet(tmp_path, image_feature=image_feature)
    verl_reads = image_feature or row_format != "verl-0.5"  # verl 0.5.0 fails on plain structs
    read_by_verl = path if verl_reads else write_exif_photo_parquet(tmp_path, image_feature=True)
    cache = tmp_path / "verl-cache"
    runs = formats.verl([read_by_verl], model_dir, [CONFIG], cache, row_format, BATCH, processor=model_dir)
    expected = runs[0]
    assert "error" not in expected, expected.get("error")
    assert len(expected["rows"]) == len(exif_photo_rows())
    assert_same_batches(formats.ours([path], model_dir, CONFIG, row_format, BATCH, model_dir), expected["batches"])
    if not verl_reads:
        refused = formats.verl([path], model_dir, [CONFIG], cache, row_format, BATCH, processor=model_dir)[0]
        assert "error" in refused, "verl reads plain image structs: compare with its rows of them"


def test_an_image_column_is_sized_and_decoded_turned_a_plain_struct_as_stored():
    """The rule itself: HF datasets 2.19 and later turn an ``Image()`` column's images (a JPEG's Orientation from its
    EXIF or its XMP, a PNG's from its eXIf chunk); a size read for the grid turns with the pixels."""
    from PIL import Image

    for row in exif_photo_rows():
        for value in row["images"]:
            data = value["bytes"]
            with Image.open(io.BytesIO(data)) as stored:
                stored.load()
                orientation = stored.getexif().get(274)
                width, height = stored.size
            turned = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
            assert image_size(data) == (width, height) and image_size(data, turned=True) == turned
            assert decode_rgb(data)[0].shape[:2] == (height, width)
            assert decode_rgb(data, turned=True)[0].shape[:2] == turned[::-1]
            assert decode_rgb(data, turned=True, pixels=False)[0].shape[:2] == turned[::-1]


@pytest.mark.parametrize(("installed", "turns"), [("2.18.0", False), ("2.19.0", True), ("4.4.1", True), (None, True)])
def test_the_installed_datasets_decides_whether_images_turn(monkeypatch, installed, turns):
    from importlib import metadata

    def version(name: str) -> str:
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(metadata, "version", version)
    datasets_turns_images.cache_clear()  # read once per process: the installed release does not change under it
    try:
        assert datasets_turns_images() is turns
    finally:
        datasets_turns_images.cache_clear()
