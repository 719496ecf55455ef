"""Multimodal stages after tokenization: decode (CPU) and vision preprocessing (CPU or GPU).

Decode: encoded image bytes -> RGB pixels, once (PIL ``convert("RGB")``, as verl). The pixels travel as plain Arrow
structs (width, height, rgb bytes) and become ``multi_modal_data["image"]`` PIL images at the consumer.

Vision: RGB pixels -> the image processor's ``pixel_values`` / ``image_grid_thw`` with torch ops on ``device``
(transformers' torchvision-backed Qwen2-VL image processor: resize, rescale, normalize, patchify). One processor call
per batch; outputs are split back per row by the grids. The grids must equal the ones the tokenize stage derived from
the image headers (they decided how many pad tokens ``input_ids`` holds).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ingest.stages.tokenize import IMAGE_GRIDS_COLUMN, MEDIA_BYTES_COLUMN
from ingest.vision import IMAGE_STRUCT, TENSOR_STRUCT, decode_rgb, image_record, tensor_record

MULTI_MODAL_DATA = "multi_modal_data"
MULTI_MODAL_INPUTS = "multi_modal_inputs"
_DATA_TYPE = pa.struct([("image", pa.list_(IMAGE_STRUCT))])


class DecodeStage:
    """``_media_image_bytes`` -> ``multi_modal_data`` (RGB pixels), in place of the bytes column."""

    def __call__(self, table: pa.Table) -> pa.Table:
        if MEDIA_BYTES_COLUMN not in table.column_names:
            return table
        encoded = table.column(MEDIA_BYTES_COLUMN).to_pylist()
        data = [{"image": [image_record(*decode_rgb(b)) for b in images]} for images in encoded]
        index = table.column_names.index(MEDIA_BYTES_COLUMN)
        return table.set_column(index, MULTI_MODAL_DATA, pa.array(data, type=_DATA_TYPE))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class VisionStage:
    """``multi_modal_data`` pixels -> ``multi_modal_inputs`` (pixel_values, image_grid_thw) on ``device``."""

    def __init__(self, processor_path: str, device: str = "cpu", return_multi_modal_inputs: bool = True):
        from transformers import AutoImageProcessor

        self.device = resolve_device(device)
        self.image_processor = AutoImageProcessor.from_pretrained(processor_path)
        self.return_multi_modal_inputs = return_multi_modal_inputs

    def pixel_values(self, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        import torch

        tensors = [torch.from_numpy(np.array(rgb)).permute(2, 0, 1) for rgb in images]  # writable copies
        out = self.image_processor(images=tensors, return_tensors="pt", device=self.device)
        return out["pixel_values"].float().cpu().numpy(), out["image_grid_thw"].cpu().numpy().astype(np.int64)

    def __call__(self, table: pa.Table) -> pa.Table:
        if MULTI_MODAL_DATA not in table.column_names:
            return table
        data = table.column(MULTI_MODAL_DATA).to_pylist()
        per_row = [
            [np.frombuffer(r["rgb"], np.uint8).reshape(r["height"], r["width"], 3) for r in d["image"]] for d in data
        ]
        flat = [img for imgs in per_row for img in imgs]
        inputs: list = [None] * len(per_row)
        if flat:
            pixel_values, grids = self.pixel_values(flat)
            expected = [g for row in table.column(IMAGE_GRIDS_COLUMN).to_pylist() for g in row]
            if grids.tolist() != expected:
                raise RuntimeError(f"vision grids {grids.tolist()} differ from the tokenizer's {expected}")
            patches = np.cumsum([0] + [int(np.prod(g)) for g in grids])
            k = 0
            for i, imgs in enumerate(per_row):
                if imgs:
                    rows = slice(patches[k], patches[k + len(imgs)])
                    inputs[i] = {
                        "pixel_values": tensor_record(pixel_values[rows]),
                        "image_grid_thw": tensor_record(grids[k : k + len(imgs)]),
                    }
                    k += len(imgs)
        table = table.drop_columns([IMAGE_GRIDS_COLUMN])
        if not self.return_multi_modal_inputs:
            return table
        index = table.column_names.index(MULTI_MODAL_DATA) + 1
        inputs_type = pa.struct([("pixel_values", TENSOR_STRUCT), ("image_grid_thw", TENSOR_STRUCT)])
        return table.add_column(index, MULTI_MODAL_INPUTS, pa.array(inputs, type=inputs_type))
