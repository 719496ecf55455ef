"""SFT training samples: one-pass chat rendering with per-token tags, loss masks, media placeholders.

The contract is the semantics of the ``renderers`` package's ``build_training_sample`` (``docs/sft.md`` describes the
tagging rules). In short:

- A renderer renders the conversation once with the model's chat template (the Jinja environment of
  ``ingest.tokenizer.template``, what ``apply_chat_template`` renders), encodes the text in one backend call with
  character offsets, and tags every token with the message it came from (-1: scaffolding), whether the model samples it
  and whether it is message body. Token ids therefore equal ``apply_chat_template(messages, tokenize=True)``.
- ``ChatMLRenderer`` (ChatML templates: Qwen2-VL, Qwen2.5, Qwen3, ...) knows the turn structure
  ``<|im_start|>role\\n body <|im_end|>``: sampled = assistant body + its ``<|im_end|>``.
  ``TemplateRenderer`` (any other template) attributes characters to messages by prefix rendering and cannot tell
  sampled tokens, so ``build_training_sample`` needs ``role_to_mask`` with it.
- Images / videos in message content are expanded into pad runs of ``grid.prod() // merge_size**2`` tokens (image
  grids from the image header and the processor geometry, as on the RL path; pixels by the RL path's vision stage).
- ``shift_and_truncate`` and ``pack`` are the consumer side: causal shift in lockstep, a cut that never splits a
  placeholder run, packing with explicit ``seq_lens``.

Modules: ``data`` (types), ``render`` (renderers), ``media`` (images / videos), ``sample``
(``build_training_sample``), ``sequence`` (shift / truncate / pack). Pure Python + numpy; transformers and torch
are imported only when media is processed. CPU only.

A leaf library: nothing here imports Ray, a pipeline stage or an actor. The Ray Data mode lives beside the RL one:
``build_sft_dataset`` in ``ingest.datasets.sft``, its collates beside ``VerlCollate`` (``rowformat.sft_collate``);
the names below resolve there on first use.
"""

from ingest.lazy import lazy_exports
from ingest.sft.data import (
    MODALITY_TOKEN_TYPES,
    MediaItem,
    ModalityData,
    PlaceholderRange,
    RenderedConversation,
    RenderedTrainingSample,
    SFTRenderError,
    TrainingSequence,
    mm_token_type_ids,
)
from ingest.sft.render import ChatMLRenderer, Renderer, TemplateRenderer, create_renderer
from ingest.sft.sample import build_training_sample, conversation_problem
from ingest.sft.sequence import pack, shift_and_truncate
from ingest.sft.tokenizers import HFChatTokenizer

__all__ = [
    "MODALITY_TOKEN_TYPES",
    "ChatMLRenderer",
    "HFChatTokenizer",
    "MediaItem",
    "ModalityData",
    "PlaceholderRange",
    "PrimeRLCollate",
    "RenderedConversation",
    "RenderedTrainingSample",
    "Renderer",
    "SFTCollate",
    "SFTRenderError",
    "TemplateRenderer",
    "TrainingSequence",
    "build_sft_dataset",
    "build_training_sample",
    "conversation_problem",
    "create_renderer",
    "mm_token_type_ids",
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
