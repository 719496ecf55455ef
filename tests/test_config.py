"""``DataConfig`` (``ingest/config.py``): dict, DictConfig and verl's data keys, defaults, validation."""

from __future__ import annotations

import pytest

from ingest import DataConfig


def test_config_accepts_dict_dictconfig_and_verl_keys():
    from omegaconf import OmegaConf

    verl_data = OmegaConf.create(
        {
            "train_files": "~/data/gsm8k/train.parquet",
            "prompt_key": "prompt",
            "max_prompt_length": 512,
            "max_response_length": 1024,
            "train_batch_size": 1024,
            "truncation": "left",
            "filter_overlong_prompts": True,
            "return_raw_chat": "${data.flag}" if False else True,
            "custom_cls": {"path": None, "name": None},
        }
    )
    cfg = DataConfig.from_any(verl_data)
    assert (cfg.max_prompt_length, cfg.truncation, cfg.return_raw_chat) == (512, "left", True)
    assert DataConfig.from_any({"max_prompt_length": 64}).max_prompt_length == 64
    defaults = DataConfig()
    assert (defaults.truncation, defaults.max_prompt_length, defaults.filter_overlong_prompts) == ("error", 1024, True)
    assert (defaults.image_key, defaults.video_key, defaults.return_multi_modal_inputs) == ("images", "videos", True)
    with pytest.raises(ValueError, match="truncation"):
        DataConfig.from_any({"truncation": "sideways"})
    assert DataConfig(decode_pool_max_size=0).decode_pool_max_size == 0  # no decode pool: tokenizer actors decode
    assert DataConfig(vision_pool_max_size=0).vision_pool_max_size == 0  # no vision pool: the actors before it
    with pytest.raises(ValueError, match="tokenizer_pool_min_size"):
        DataConfig(tokenizer_pool_max_size=0)
    for pool in ("decode", "vision"):
        with pytest.raises(ValueError, match=f"{pool}_pool_min_size"):
            DataConfig(**{f"{pool}_pool_max_size": -1})
    with pytest.raises(ValueError, match="need a vision pool"):
        DataConfig(vision_pool_max_size=0, vision_num_gpus=0.5)
    assert DataConfig(vision_decode_video_on_device=True, vision_video_decoder="torchcodec").vision_video_decoder
    with pytest.raises(ValueError, match="vision_video_decoder must be one of"):
        DataConfig(vision_decode_video_on_device=True, vision_video_decoder="decord")
    with pytest.raises(ValueError, match="only decodes video files with vision_decode_video_on_device: true"):
        DataConfig(vision_video_decoder="pyav")


def test_row_format_auto_follows_the_installed_verl(monkeypatch):
    """``row_format: auto`` resolves on the driver to the installed verl's release line (``verl-0.5`` with none), and
    a release whose rows are not built is one error naming it."""
    import ingest.config as config
    from ingest import VerlCollate

    assert DataConfig().row_format == "verl-0.5"
    monkeypatch.setattr(config, "installed_verl_version", lambda: None)
    assert DataConfig(row_format="auto").row_format == "verl-0.5"
    monkeypatch.setattr(config, "installed_verl_version", lambda: "0.6.1")
    assert DataConfig.from_any({"row_format": "auto"}).row_format == "verl-0.6"
    assert VerlCollate(row_format="auto").row_format == "verl-0.6"
    monkeypatch.setattr(config, "installed_verl_version", lambda: "0.9.1")
    assert DataConfig(row_format="auto").row_format == "verl-0.9"
    with pytest.raises(ValueError, match="row_format verl-0.5 builds rows the installed verl 0.9.1 does not read"):
        DataConfig(row_format="verl-0.5")  # the installed verl cannot consume them: one error naming both
    monkeypatch.setattr(config, "installed_verl_version", lambda: "0.8.0")  # checked against verl 0.8.0 itself
    assert DataConfig(row_format="auto").row_format == "verl-0.9"
    assert VerlCollate(row_format="auto").row_format == "verl-0.9"
    with pytest.raises(ValueError, match="the installed verl 0.8.0 does not read .* set row_format to verl-0.9"):
        DataConfig(row_format="verl-0.6")
    monkeypatch.setattr(config, "installed_verl_version", lambda: "0.7.1")
    assert DataConfig(row_format="auto").row_format == "verl-0.7"
    assert VerlCollate(row_format="auto").row_format == "verl-0.7"
    with pytest.raises(ValueError, match="the installed verl 0.7.1 does not read .* set row_format to verl-0.7"):
        DataConfig(row_format="verl-0.9")
    monkeypatch.setattr(config, "installed_verl_version", lambda: "0.7.0")  # its rows differ from 0.7.1's
    with pytest.raises(ValueError, match="found verl 0.7.0 installed, .* differ from 0.7.1's"):
        DataConfig(row_format="auto")
    assert DataConfig(row_format="verl-0.7").row_format == "verl-0.7"  # a release not checked here: any format goes
    with pytest.raises(ValueError, match="row_format must be one of"):
        DataConfig(row_format="verl-1.0")
    with pytest.raises(ValueError, match="no vision stage"):
        DataConfig(row_format="verl-0.9", vision_decode_jpeg_on_device=True)
    with pytest.raises(ValueError, match="row_format verl-0.7 rows carry"):
        DataConfig(row_format="verl-0.7", vision_decode_video_on_device=True)
