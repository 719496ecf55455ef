"""Qwen2-VL rope position ids (verl.models.transformers.qwen2_vl.get_rope_index, in numpy): the (3, M) position ids
of a prompt with images and videos."""

from __future__ import annotations

import numpy as np


def rope_position_ids(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    image_grids: list,
    video_grids: list,
    *,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    merge_size: int,
) -> np.ndarray:
    """(3, M) int64 position ids for one row; pads get 1. Videos use 1.0 s per grid (second_per_grid_ts dropped)."""
    m = input_ids.shape[0]
    if not image_grids and not video_grids:
        position = np.cumsum(attention_mask) - 1
        position[attention_mask == 0] = 1
        return np.broadcast_to(position, (3, m)).astype(np.int64)
    positions = np.ones((3, m), dtype=np.int64)
    tokens = input_ids[attention_mask == 1]
    starts = np.flatnonzero(tokens == vision_start_token_id)
    following = tokens[starts + 1] if starts.size else np.array([], dtype=tokens.dtype)
    remain_images = int((following == image_token_id).sum())
    remain_videos = int((following == video_token_id).sum())
    token_list = tokens.tolist()
    parts: list[np.ndarray] = []
    st, image_index, video_index = 0, 0, 0
    for _ in range(remain_images + remain_videos):
        ed_image = token_list.index(image_token_id, st) if remain_images > 0 and image_token_id in token_list else None
        ed_video = token_list.index(video_token_id, st) if remain_videos > 0 and video_token_id in token_list else None
        ed_image = len(token_list) + 1 if ed_image is None else ed_image
        ed_video = len(token_list) + 1 if ed_video is None else ed_video
        if ed_image < ed_video:
            t, h, w = image_grids[image_index]
            second_per_grid = 0.0
            image_index, remain_images, ed = image_index + 1, remain_images - 1, ed_image
        else:
            t, h, w = video_grids[video_index]
            second_per_grid = 1.0
            video_index, remain_videos, ed = video_index + 1, remain_videos - 1, ed_video
        gt, gh, gw = int(t), int(h) // merge_size, int(w) // merge_size
        text_len = ed - st
        st_idx = int(parts[-1].max()) + 1 if parts else 0
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        t_index = (np.repeat(np.arange(gt), gh * gw) * second_per_grid * 2).astype(np.int64)
        h_index = np.tile(np.repeat(np.arange(gh), gw), gt)
        w_index = np.tile(np.arange(gw), gt * gh)
        parts.append(np.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st = ed + gt * gh * gw
    if st < len(token_list):
        st_idx = int(parts[-1].max()) + 1 if parts else 0
        text_len = len(token_list) - st
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
    positions[:, attention_mask == 1] = np.concatenate(parts, axis=1).reshape(3, -1)
    return positions


def with_text_positions(position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """verl 0.6's (B, 4, M) positions: a text row (0, 1, ... over the valid tokens, 1 on pads) on top of the (B, 3, M)
    rope rows."""
    mask = attention_mask.astype(bool)
    text = np.where(mask, np.cumsum(mask, axis=1) - 1, 1).astype(np.int64)
    return np.concatenate([text[:, None, :], position_ids], axis=1)
