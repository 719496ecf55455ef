"""``IngestDataset``: what verl's ``create_rl_dataset`` builds under ``data.custom_cls`` instead of ``RLHFDataset``.

verl builds its datasets before the trainer exists (0.5 and 0.6's ``TaskRunner``, 0.9's ``_init_dataloader``), and
``RLHFDataset`` loads every file whole and runs the overlong filter over all of it right there. This class is that
hook's stand-in: it reads nothing on construction; its ``len()`` is the rows one epoch of the pipeline yields (counted
once and cached, ``length.count_rows``), which verl's own code turns into steps per epoch; and it makes the
``VerlDataLoader``\\ s that ``ingest_trainer`` puts in place of the ``StatefulDataLoader``\\ s verl wraps around it.
Rows come only from those loaders: indexing this object is an error.

Where verl is installed the class derives from its ``RLHFDataset`` for the class-level helpers verl calls on
whatever class ``data.custom_cls`` names: verl 0.9's agent loop extracts each prompt's images and videos through
``dataset_cls.process_multi_modal_info`` (or ``process_vision_info``), so the rollout's model inputs are exactly
those verl's own class makes. Nothing of ``RLHFDataset``'s constructor or row methods runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from ingest.verl.loader import VerlDataLoader

try:  # verl's class, for its class-level vision helpers (above); a plain torch Dataset where verl is not installed
    from verl.utils.dataset.rl_dataset import RLHFDataset as _VerlDataset
except ImportError:
    _VerlDataset = Dataset

# verl's ``data.custom_cls`` entry that selects this class (``pkg://`` imports a module by name in verl 0.5 to 0.9)
CUSTOM_CLS = {"path": "pkg://ingest.verl.dataset", "name": "IngestDataset"}


def select_ingest_dataset(config: Any) -> None:
    """Point a verl config's ``data.custom_cls`` at ``IngestDataset`` (an OmegaConf config, changed in place); another
    class there is an error: the pipeline makes the rows."""
    from omegaconf import open_dict

    chosen = config.data.get("custom_cls") or {}
    if chosen.get("path") not in (None, CUSTOM_CLS["path"]):
        raise ValueError(
            f"data.custom_cls selects {chosen.get('name')} from {chosen.get('path')}: the ingest pipeline makes the "
            "rows, so it cannot use another dataset class; remove data.custom_cls"
        )
    with open_dict(config):
        config.data.custom_cls = dict(CUSTOM_CLS)


def data_mapping(config: Any) -> dict:
    """A verl ``data:`` section (an OmegaConf ``DictConfig``, resolved, or any mapping) as a plain dict."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    except ValueError:  # not an OmegaConf object
        return dict(config)


def _files(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _model_path(model: Any) -> str | None:
    """A tokenizer or processor object (verl passes loaded ones) as the model folder it was loaded from."""
    if model is None or isinstance(model, str):
        return model
    return getattr(model, "name_or_path", None) or model.tokenizer.name_or_path


def _max_samples_seed(config: Mapping[str, Any]) -> int | None:
    """The seed of verl 0.9.1's draw of ``max_samples`` rows (``RLHFDataset``): with the section's ``shuffle`` (False
    where unset, as verl reads it) its ``seed``, or where that is null a fresh one (verl's draw is unseeded then; this
    one is drawn once, so the count and every epoch read the same rows); without shuffle None (the first rows)."""
    import numpy as np

    if not config.get("shuffle", False):
        return None
    seed = config.get("seed")
    return int(seed) if seed is not None else int(np.random.SeedSequence().generate_state(1)[0])


class IngestDataset(_VerlDataset):
    """verl's dataset constructor signature (``data_files, tokenizer, processor, config, max_samples``); ``len()`` is
    one epoch's rows after the filter and quarantine. ``row_format`` defaults to ``auto`` (the installed verl's)."""

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Any,
        processor: Any = None,
        config: Mapping[str, Any] | None = None,
        max_samples: int = -1,
    ):
        self.files = _files(data_files)
        self.model_path = _model_path(tokenizer)
        self.processor_path = self.model_path if processor is not None else None
        self.config = data_mapping(config or {})
        self.config.setdefault("row_format", "auto")
        if max_samples is not None and max_samples > 0:
            # verl 0.9 draws max_samples rows of its loaded table here, before its filter: the same rows are drawn
            # from the footers' count, before the stream (DataConfig.max_samples)
            self.config["max_samples"] = int(max_samples)
            self.config["max_samples_seed"] = _max_samples_seed(self.config)
        self._num_rows: int | None = None

    @property
    def num_rows(self) -> int:
        """Rows one epoch yields: counted by the pipeline once, then from the cache in ``cache_dir``."""
        if self._num_rows is None:
            self._num_rows = VerlDataLoader(self.files, self.model_path, self.config, 1, self.processor_path).num_rows
        return self._num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> dict:
        raise TypeError(
            "IngestDataset holds no rows: iterate the trainer's dataloader (ingest_trainer puts the pipeline's "
            "VerlDataLoader there)"
        )

    def __getstate__(self) -> dict:  # RLHFDataset's own expects its dataframe attributes
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @classmethod
    async def process_vision_info(cls, messages: list[dict], image_patch_size: int, config: Any) -> tuple:
        """verl 0.7's agent loop asks this for a prompt's images and videos: as ``process_multi_modal_info``."""
        from ingest.verl.rollout_media import prompt_media, sample_media

        payload = prompt_media(messages)
        if payload is None:
            return await super().process_vision_info(messages, image_patch_size=image_patch_size, config=config)
        return sample_media(payload)[:2]

    @classmethod
    async def process_multi_modal_info(cls, messages: list[dict], image_patch_size: int, config: Any) -> tuple:
        """verl 0.9's agent loop asks this for a prompt's images, videos and audios: for a prompt whose media were
        handed off (``data.media_handoff``: its items are media URIs) the payload's, fetched once per process;
        else verl's own."""
        from ingest.verl.rollout_media import prompt_media, sample_media

        payload = prompt_media(messages)
        if payload is None:
            return await super().process_multi_modal_info(messages, image_patch_size=image_patch_size, config=config)
        return sample_media(payload)

    def loader(
        self, batch_size: int | None, *, drop_last: bool, shuffle: bool | None = None, media_held: int | None = None
    ) -> VerlDataLoader:
        """The ``VerlDataLoader`` over these files and settings (``batch_size`` None: every row in one batch, as
        verl's val loader); ``shuffle`` overrides ``data.shuffle`` (verl's ``validation_shuffle``); ``media_held``
        is ``media_handoff_held`` where the settings leave it unset."""
        config = dict(self.config)
        if shuffle is not None:
            config["shuffle"] = shuffle
        if media_held is not None and config.get("media_handoff_held") is None:
            config["media_handoff_held"] = media_held
        return VerlDataLoader(
            self.files,
            self.model_path,
            config,
            batch_size,
            self.processor_path,
            drop_last=drop_last,
            num_rows=self.num_rows,
        )
