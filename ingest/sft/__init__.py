"""SFT training samples at Ray Data scale, made by the ``renderers`` package itself (the ``sft`` extra).

Each render actor builds one renderer with ``renderers.create_renderer`` and calls renderers' own
``build_training_sample`` per conversation with the caller's keyword arguments (``engine``). The pipeline adds what
renderers does not have: streaming Parquet (local, S3, HDFS), actor pools, images from their columns, the causal
shift, truncation that never splits a media run and packing with ``seq_lens`` as prime-rl consumes them
(``sequence``), and accounting with quarantine of bad rows (``conversation``, ``ingest.stages.sft``).
See docs/sft.md.

A prime-rl user's ``from renderers import create_renderer, build_training_sample`` is unchanged beside this package:
nothing here takes their names.

Modules: ``engine`` (renderers' calls), ``conversation`` (the checks before them), ``data`` / ``sequence`` (shift,
truncate, pack). ``build_sft_dataset`` lives in ``ingest.datasets.sft``, its collates beside ``VerlCollate``
(``rowformat.sft_collate``); the names below resolve there on first use.
"""

from ingest.lazy import lazy_exports
from ingest.sft.conversation import SFTRenderError, conversation_problem
from ingest.sft.data import ModalityData, PlaceholderRange, TrainingSequence
from ingest.sft.sequence import pack, shift_and_truncate

__all__ = [
    "ModalityData",
    "PlaceholderRange",
    "PrimeRLCollate",
    "SFTCollate",
    "SFTRenderError",
    "TrainingSequence",
    "build_sft_dataset",
    "conversation_problem",
    "pack",
    "shift_and_truncate",
]

_DATASET_NAMES = {
    "PrimeRLCollate": "ingest.rowformat.sft_collate",
    "SFTCollate": "ingest.rowformat.sft_collate",
    "build_sft_dataset": "ingest.datasets.sft",
    "plan_sft_input": "ingest.datasets.sft_plan",
}
__getattr__, __dir__ = lazy_exports(globals(), _DATASET_NAMES)
