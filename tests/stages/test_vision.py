"""The vision stage in-process (``ingest/stages/vision.py``): other image processors through transformers, uint8
patches the collate finishes, torch threads held to the actor's CPU share, an explicit torchcodec that does not
load."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from ingest.config import DataConfig
from tests.support.media import sample_rgbs


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
    rgbs = sample_rgbs()[:3]
    values, grids = stage.pixel_values(rgbs)
    assert stage.pixels is None
    theirs = AutoImageProcessor.from_pretrained(str(model))(
        images=[torch.from_numpy(rgb.copy()).permute(2, 0, 1) for rgb in rgbs], return_tensors="pt"
    )
    assert np.array_equal(values, theirs["pixel_values"].numpy()) and np.array_equal(grids, theirs["image_grid_thw"])


def test_vision_stage_blocks_carry_uint8_patches_that_the_collate_finishes(model_dir):
    """The vision stage's ``pixel_values`` records hold uint8 patches (an eighth of the float32 bytes); the collate
    turns them into exactly the processor's float32 values, per row, on the requested device."""
    from ingest.media.pixels import ImagePixels
    from ingest.rowformat.collate import _media_inputs
    from ingest.stages.vision import VisionStage

    pixels = ImagePixels.from_dir(model_dir)
    rgbs = sample_rgbs()
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


def test_an_explicit_torchcodec_that_does_not_load_fails_at_actor_start(model_dir, monkeypatch):
    from ingest.media import video
    from ingest.stages.vision import VisionStage

    monkeypatch.setattr(video, "torchcodec_error", lambda: "it found no FFmpeg libraries it can load")
    with pytest.raises(RuntimeError, match=r"torchcodec does not load here .*ingest ffmpeg-libdir"):
        VisionStage(
            model_dir,
            DataConfig(vision_device="cpu", vision_video_decoder="torchcodec", vision_decode_video_on_device=True),
        )
    assert (
        VisionStage(model_dir, DataConfig(vision_device="cpu")).video_decoder == "auto"
    )  # "auto" falls back to PyAV instead
