"""``DataConfig``: verl 0.5.0's ``data`` keys (with the dataset's code defaults) plus this pipeline's own keys; and
``StageContext``, what a stage knows of its run besides the config. Both travel to every actor as they are."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ingest.memory import ARROW_MEMORY_POOLS, DEFAULT_ARROW_MEMORY_POOL

# how the vision stage may decode video files (vision_video_decoder): torchcodec on CUDA where it loads, else PyAV
# ("auto"), or one of them on any device
VIDEO_DECODERS = ("auto", "pyav", "torchcodec")
# how the vision actors resize images on a CUDA device (vision_device_resize): "triton" (two kernels per block, the
# CPU kernel's bytes), "torch" (float passes per image, within 2 levels of the CPU kernel), or "auto": triton where it
# imports and runs, else torch
DEVICE_RESIZES = ("auto", "torch", "triton")

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("left", "right", "middle", "error")
# the verl release whose RLHFDataset rows (and collate_fn) the pipeline hands out; verl-0.6 covers text prompts so far;
# verl-0.7 and verl-0.9 are the raw_prompt rows of verl 0.7 and later (no ids: the rollout tokenizes): verl-0.9 checked
# against verl 0.9.1 and 0.8.0 (whose rows are 0.9.1's, but for path-string media, which 0.8.0 drops), verl-0.7
# against 0.7.1 (0.9.1's rows; its filter measures a media prompt without expanding the media, and it takes no
# path-string media). "auto": the installed verl's (resolve_row_format)
ROW_FORMATS = ("verl-0.5", "verl-0.6", "verl-0.7", "verl-0.9")
RAW_PROMPT_FORMATS = ("verl-0.7", "verl-0.9")
SEPARATE_POOL_SIZE = 2  # a media pool's max size when its stage has a pool of its own and the config sets none
# the row format of each verl release line that has one here (each line checked against a release of it as an oracle)
_RELEASE_LINES = {"0.5": "verl-0.5", "0.6": "verl-0.6", "0.7": "verl-0.7", "0.8": "verl-0.9", "0.9": "verl-0.9"}
# releases of those lines whose rows differ from the release their line was checked against
_RELEASES_APART = {
    "0.7.0": "its image-struct and video items and, under transformers 5, its text filter's lengths differ from 0.7.1's"
}


def installed_verl_version() -> str | None:
    """The version of the verl package this process would import; None where there is none."""
    from ingest.installed import installed_version

    return installed_version("verl")


# the first HF datasets whose Image() decode turns an image by its EXIF Orientation (ImageOps.exif_transpose)
_DATASETS_TURNING = (2, 19)


@functools.cache  # the installed release does not change under a process; reading its metadata costs milliseconds
def datasets_turns_images() -> bool:
    """Whether HF datasets' ``Image()`` decode, as installed here, turns an image by its EXIF Orientation (2.19 and
    later; where datasets is not installed, the rule of those releases)."""
    from ingest.installed import installed_version

    try:
        major, minor = (int(part) for part in (installed_version("datasets") or "").split(".")[:2])
    except ValueError:  # not installed, or a version that is not numbers
        return True
    return (major, minor) >= _DATASETS_TURNING


def _release_line(installed: str) -> str | None:
    """The row format of the verl release ``installed``; None for a release none is checked against."""
    if installed in _RELEASES_APART:
        return None
    return _RELEASE_LINES.get(".".join(installed.split(".")[:2]))


def resolve_row_format(row_format: str) -> str:
    """``row_format`` as one of ``ROW_FORMATS``. ``auto``: the format of the installed verl's release line (0.5, 0.6,
    0.7, 0.8 or 0.9), ``verl-0.5`` where no verl is installed; a release with no format here is an error naming both.
    An explicit format that the installed verl's line does not read (verl 0.5 given verl-0.9 rows) is an error too;
    with no verl installed, or a release not checked here, any format goes."""
    if row_format != "auto":
        if row_format not in ROW_FORMATS:
            raise ValueError(f"row_format must be one of {(*ROW_FORMATS, 'auto')}, got {row_format!r}")
        installed = installed_verl_version()
        line = _release_line(installed) if installed else None
        if line is not None and line != row_format:
            raise ValueError(
                f"row_format {row_format} builds rows the installed verl {installed} does not read (it reads "
                f"{line} rows): set row_format to {line} or auto"
            )
        return row_format
    installed = installed_verl_version()
    if installed is None:
        return "verl-0.5"
    line = _release_line(installed)
    if line is None:
        why = f" ({_RELEASES_APART[installed]})" if installed in _RELEASES_APART else ""
        raise ValueError(
            f"row_format: auto found verl {installed} installed, whose rows this pipeline does not build yet{why} "
            f"(row formats: {', '.join(ROW_FORMATS)}); set row_format to one of them"
        )
    return line


# Keys of a verl ``data:`` section that the 0.5.0 dataset does not read (the trainer or sampler does). Accepted so a
# verl config works unchanged; they have no effect here.
VERL_KEYS_NOT_READ_BY_DATASET = frozenset(
    {
        "tokenizer",
        "train_files",
        "val_files",
        "reward_fn_key",
        "max_response_length",
        "train_batch_size",
        "val_batch_size",
        "return_raw_input_ids",
        "dataloader_num_workers",
        "validation_shuffle",
        "trust_remote_code",
        "custom_cls",
        "sampler",
        "datagen",
        "gen_batch_size",
        "video_fps",
        # verl 0.9: each split's max_samples, which the dataset class gets as its own argument (max_samples below)
        "train_max_samples",
        "val_max_samples",
    }
)


@dataclasses.dataclass
class DataConfig:
    """Everything ``build_dataset`` reads. Defaults are verl 0.5.0's code defaults (``rl_dataset.py``).

    verl keys: ``prompt_key`` .. ``return_multi_modal_inputs``. Pipeline keys follow.
    """

    # --- verl 0.5.0 RLHFDataset keys ---
    prompt_key: str = "prompt"
    image_key: str = "images"
    video_key: str = "videos"
    max_prompt_length: int = 1024
    truncation: str = "error"
    filter_overlong_prompts: bool = True
    return_raw_chat: bool = False
    return_full_prompt: bool = False
    return_multi_modal_inputs: bool = True
    need_tools_kwargs: bool = False
    filter_prompts: bool = True  # read by verl 0.5.0 but unused there; kept for config compatibility
    cache_dir: str = "~/.cache/verl/rlhf"  # verl copies files here; this pipeline streams and never uses it
    use_shm: bool = False  # likewise unused: nothing is copied
    filter_overlong_prompts_workers: int | None = None  # verl's filter pass; the in-stream filter needs no workers
    chat_template_func: str | None = None  # verl 0.5.0 reads but never calls it; never imported here either
    # verl 0.6 and later: extra apply_chat_template arguments (the template's variables, or chat_template); verl 0.5.0
    # does not read it, so verl-0.5 rows ignore it too
    apply_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    # verl 0.9: qwen-vl-utils' resize factor (2 x this) before the processor's, in the overlong filter's image lengths;
    # None: the processor's patch size (verl's code default; its legacy yaml sets 14)
    image_patch_size: int | None = None
    # verl 0.6 and later: a verl tool config (YAML); its tools' schemas go to the chat template where the overlong
    # filter measures a prompt, and only there (the rows are rendered without them, as in verl). Read once, here, on
    # the driver, into tool_schemas (ingest/tool_schemas.py); verl-0.5 rows ignore it, as verl 0.5.0 does
    tool_config_path: str | None = None
    tool_schemas: list | None = None
    # verl 0.9: Python function tools; their schemas come from importing that code, which this pipeline does not do
    function_tool_path: str | None = None
    # verl 0.9: extra processor arguments its agent loop passes on every processor call; read here only where the
    # pipeline makes the rollout's media (media_handoff), so they are made as verl's agent loop would
    mm_processor_kwargs: dict = dataclasses.field(default_factory=dict)
    # verl 0.9: the audio column, removed from its rows; this pipeline builds no audio prompts (a row with audio is bad)
    audio_key: str = "audios"

    # --- sampler keys verl reads in create_rl_sampler (same defaults) ---
    shuffle: bool = True
    seed: int = 1
    # verl 0.9's dataset max_samples (data.train_max_samples / val_max_samples): this many rows drawn from the whole
    # input (every file, in order) before the stream, as its RLHFDataset draws them before its filter: with a
    # max_samples_seed numpy's choice seeded by it (verl: where data.shuffle is on, seeded by data.seed), else the
    # first rows. -1: every row
    max_samples: int = -1
    max_samples_seed: int | None = None

    # --- pipeline keys ---
    # whose rows: ROW_FORMATS, or "auto" (the installed verl's; resolved here, on the driver, so actors need no verl)
    row_format: str = "verl-0.5"
    read_rows_per_task: int = 1024  # rows per read unit: a streaming start needs units smaller than a file
    # two units of this many rows are cut off the first unit in read order (0: not cut): a map task hands on its block
    # when its whole unit is done, and Ray Data's iterator takes in the second block before it yields the first, so the
    # first batch then waits for two small units, not for full ones
    read_first_unit_rows: int = 128
    tokenizer_pool_min_size: int = 1
    # None: chosen from the cluster (ingest/datasets/layout.py): text rows one per CPU but one, media rows 2
    tokenizer_pool_max_size: int | None = None
    tokenizer_batch_size: int = 256  # rows per map_batches call on a tokenizer actor
    tokenizer_num_cpus: float = 0.5  # per actor; reads run inside these actors (Ray Data fuses them)
    decode_pool_min_size: int = 1
    # 0: no decode pool, the tokenizer actors decode (fewer processes, small machines). None (the default) with
    # vision_pool_max_size None too: both chosen from the cluster (ingest/datasets/layout.py)
    decode_pool_max_size: int | None = None
    decode_num_cpus: float = 0.5
    vision_pool_min_size: int = 1
    # 0: no vision pool, the actors of the stage before it (decode, or the tokenizer actors when decode_pool_max_size
    # is 0 too) run the vision stage on their CPU: two processes fewer and one object-store copy of the pixels fewer
    vision_pool_max_size: int | None = None  # None: as decode_pool_max_size
    vision_num_cpus: float = 0.5
    vision_num_gpus: float = 0.0  # > 0 puts the vision pool on GPU actors (fractional allowed)
    vision_device: str = "auto"  # "cpu", "cuda", or "auto" (cuda when the actor sees a GPU)
    vision_batch_size: int = 32
    # baseline JPEGs decode in the vision actors on their device (nvJPEG through torchvision on cuda), not in the
    # decode stage; off by default: nvJPEG's pixels are within a few levels of PIL's, not equal (docs/design.md)
    vision_decode_jpeg_on_device: bool = False
    # video files decode in the vision actors (torchcodec on the GPU where it loads, else PyAV), not in the decode
    # stage; off by default: GPU-decoded frames are close to PyAV's, not equal (docs/design.md)
    vision_decode_video_on_device: bool = False
    # the vision actors' video file decoder: "auto" (torchcodec on cuda where it loads, else PyAV), "pyav" or
    # "torchcodec" (on the actor's device, also the CPU: there its frames are PyAV's; it needs FFmpeg's libraries,
    # `python -m ingest ffmpeg-libdir` lends it PyAV's)
    vision_video_decoder: str = "auto"
    # the vision actors' image resize on CUDA: "triton" (ingest/media/triton_resize.py: a block in two kernels, the CPU
    # kernel's bytes exactly; needs triton, which CUDA builds of torch bring), "torch" (two float passes per image:
    # within 2 levels of the CPU kernel), or "auto": triton where it imports and its kernels run, else torch (with a
    # warning). The CPU always runs the uint8 kernel
    vision_device_resize: str = "auto"
    on_bad_row: str = "quarantine"  # or "raise": stop with one error naming file, row and reason
    # verl-0.7 / 0.9 rows: the vision actors make each prompt's media for the rollout once (the fetched images and
    # videos, the prompt ids, the training inputs: ingest/rollout_media.py) and the rows carry ingest-media:// URIs
    # in their place; verl's agent loop takes them through ingest.verl.agent_loop (ingest.verl.main_ppo sets it up)
    media_handoff: bool = False
    # prompts whose media the pipeline may make ahead of what the loader has taken (media_handoff): the rows carry only
    # URIs, so Ray Data's backpressure, which counts block bytes, would not hold the media back. None: one batch
    media_handoff_ahead: int | None = None
    # rows whose media stay held once handed out (media_handoff), at the least: a batch's are released once two later
    # batches and this many later rows were handed out. None: two batches. verl's v1 trainers that fetch one prompt at
    # a time and submit a step's prompts at once need more than two such batches (ingest.verl.trainer sets it there)
    media_handoff_held: int | None = None
    # Arrow's default memory pool in the pipeline's actors: "system" (glibc malloc), "mimalloc", "jemalloc" or
    # "default" (Arrow's choice, mimalloc on Linux wheels); system costs less CPU for read + tokenize + decode
    # on a 2-core VM, where mimalloc's fresh huge pages cost more than it saves (docs/design.md)
    arrow_memory_pool: str = DEFAULT_ARROW_MEMORY_POOL
    # filesystem kwargs (S3 endpoint, keys, ...); repr=False keeps secrets out of a logged config
    storage_options: dict = dataclasses.field(default_factory=dict, repr=False)
    trust_remote_code: bool = False
    # --- SFT mode (build_sft_dataset; docs/sft.md) ---
    sft_messages_key: str = "messages"  # the conversation column; without it: prompt_key + sft_completion_key
    sft_completion_key: str = "completion"  # messages = prompt + completion (message lists or plain strings)
    sft_max_length: int | None = 4096  # inputs per sample after the causal shift (cut never splits a media run)
    sft_pack_token_budget: int = 0  # > 0: pack samples in order into rows of at most this many inputs

    def __post_init__(self) -> None:
        self.row_format = resolve_row_format(self.row_format)
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        if int(self.max_prompt_length) < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        for pool in ("tokenizer", "decode", "vision"):
            low, high = getattr(self, f"{pool}_pool_min_size"), getattr(self, f"{pool}_pool_max_size")
            if high is None or (pool in ("decode", "vision") and high == 0):  # the cluster's layout / the actors before
                continue
            if not 1 <= low <= high:
                raise ValueError(f"need 1 <= {pool}_pool_min_size <= {pool}_pool_max_size, got {low}..{high}")
        if self.vision_pool_max_size == 0 and self.vision_num_gpus:
            raise ValueError(
                "vision_pool_max_size: 0 runs the vision stage in the CPU actors before it; GPU vision actors "
                f"(vision_num_gpus {self.vision_num_gpus}) need a vision pool (vision_pool_max_size >= 1)"
            )
        if self.vision_device not in ("auto", "cpu", "cuda") and not self.vision_device.startswith("cuda:"):
            raise ValueError(f"vision_device must be auto, cpu or cuda[:N], got {self.vision_device!r}")
        if self.vision_video_decoder not in VIDEO_DECODERS:
            raise ValueError(f"vision_video_decoder must be one of {VIDEO_DECODERS}, got {self.vision_video_decoder!r}")
        if self.vision_video_decoder != "auto" and not self.vision_decode_video_on_device:
            raise ValueError(
                f"vision_video_decoder: {self.vision_video_decoder} picks the vision actors' decoder, which only "
                "decodes video files with vision_decode_video_on_device: true (else the decode stage uses PyAV)"
            )
        if self.vision_device_resize not in DEVICE_RESIZES:
            raise ValueError(f"vision_device_resize must be one of {DEVICE_RESIZES}, got {self.vision_device_resize!r}")
        if self.arrow_memory_pool not in ARROW_MEMORY_POOLS:
            raise ValueError(f"arrow_memory_pool must be one of {ARROW_MEMORY_POOLS}, got {self.arrow_memory_pool!r}")
        if self.on_bad_row not in ("quarantine", "raise"):
            raise ValueError(f"on_bad_row must be 'quarantine' or 'raise', got {self.on_bad_row!r}")
        if self.read_rows_per_task < 1 or self.tokenizer_batch_size < 1:
            raise ValueError("read_rows_per_task and tokenizer_batch_size must be >= 1")
        if self.read_first_unit_rows < 0:
            raise ValueError(f"read_first_unit_rows must be >= 0, got {self.read_first_unit_rows}")
        if self.raw_prompt_rows and (self.vision_decode_jpeg_on_device or self.vision_decode_video_on_device):
            raise ValueError(
                f"row_format {self.row_format} rows carry images and video sources, not model inputs: there is no "
                "vision stage to decode on a device (vision_decode_jpeg_on_device / vision_decode_video_on_device)"
            )
        if self.media_handoff_ahead is not None and self.media_handoff_ahead < 1:
            raise ValueError(f"media_handoff_ahead must be >= 1 prompt, got {self.media_handoff_ahead}")
        if self.media_handoff_held is not None and self.media_handoff_held < 0:
            raise ValueError(f"media_handoff_held must be >= 0 rows, got {self.media_handoff_held}")
        if self.media_handoff and not self.raw_prompt_rows:
            raise ValueError(
                f"data.media_handoff: the rollout's media are handed off to verl 0.7 and 0.9's agent loop "
                f"(verl-0.7 / verl-0.9 rows), not for row_format {self.row_format}"
            )
        if self.function_tool_path and self.row_format == "verl-0.9":
            raise ValueError(
                "data.function_tool_path: the schemas of Python function tools come from importing them, which this "
                "pipeline does not do; write their schemas in a tool_config_path file (config.type: native)"
            )
        if self.tool_config_path and self.tool_schemas is None and self.row_format != "verl-0.5":
            from ingest.tool_schemas import tool_schemas

            self.tool_schemas = tool_schemas(self.tool_config_path)
        self.max_prompt_length = int(self.max_prompt_length)
        self.storage_options = dict(self.storage_options or {})
        self.apply_chat_template_kwargs = dict(self.apply_chat_template_kwargs or {})

    @classmethod
    def from_any(cls, config: DataConfig | Mapping[str, Any] | None) -> DataConfig:
        """Accept a ``DataConfig``, a plain dict or an OmegaConf ``DictConfig`` (a verl ``data:`` section)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if _is_omegaconf(config):
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a DataConfig, dict or DictConfig, not {type(config).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in config.items() if k in fields}
        unknown = sorted(k for k in config if k not in fields and k not in VERL_KEYS_NOT_READ_BY_DATASET)
        if unknown:
            logger.warning("ignoring unknown data config keys: %s", ", ".join(map(str, unknown)))
        return cls(**known)

    @property
    def fetches_plain_struct_images(self) -> int | None:
        """The patch size with which verl resizes a plain ``{bytes, path}`` struct's image by qwen-vl-utils'
        ``fetch_image`` where it does (verl 0.6's ``process_image``: ``data.image_patch_size``, 14 unless set); None
        where it does not (verl 0.5 fails on one, 0.7 and 0.9 hand the image to the processor as opened)."""
        return (self.image_patch_size or 14) if self.row_format == "verl-0.6" else None

    @property
    def raw_prompt_rows(self) -> bool:
        """Whether the rows are verl 0.7 and later's ``raw_prompt`` rows (no ids: the rollout tokenizes)."""
        return self.row_format in RAW_PROMPT_FORMATS

    def pool_max_size(self, pool: str) -> int:
        """A pool's max size: the config's, or ``SEPARATE_POOL_SIZE`` where the size is unset and no cluster layout was
        applied (actors built outside ``build_dataset``, SFT's pools, media rows' tokenizer actors)."""
        size = getattr(self, f"{pool}_pool_max_size")
        return SEPARATE_POOL_SIZE if size is None else size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _is_omegaconf(obj: object) -> bool:
    return type(obj).__module__.startswith("omegaconf")


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a stage needs of its run besides the ``DataConfig``: the run's files as errors and quarantine records name
    them (secrets redacted; indexed by the provenance column ``_ingest_file``), the ``RunLedger`` actor its counts go
    to (None: not counted), whether the provenance columns stay on the rows (``PromptStream`` needs them), and the
    files (indices) whose image column HF datasets reads as plain ``{bytes, path}`` dicts, not PIL images (no
    ``Image()`` feature in their schema metadata: ``read.files.reads_as_pil_images``); verl 0.9 builds other image
    items from those; and with ``media_handoff`` the name of the store actor that holds the rollout's media."""

    files: tuple[str, ...] = ()
    ledger: Any = None
    keep_provenance: bool = False
    files_without_image_feature: frozenset[int] = frozenset()
    media_store: str | None = None  # the read's MediaStore actor (media_handoff: ingest/rollout_media.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "files_without_image_feature", frozenset(self.files_without_image_feature))

    def plain_struct_rows(self, file_of_row: Sequence[int] | None, num_rows: int) -> list[bool]:
        """Per row (``file_of_row``: each row's file index; None: unknown, an ``Image()`` column assumed): whether its
        file's image column is plain ``{bytes, path}`` structs (``files_without_image_feature``)."""
        if file_of_row is None:
            return [False] * num_rows
        plain = self.files_without_image_feature
        return [int(f) in plain for f in file_of_row]

    def images_turned(self, plain_structs: list[bool], *, plain_structs_turned: bool) -> list[bool]:
        """Per row (``plain_structs``: ``plain_struct_rows``): whether verl gets its images turned by their EXIF
        Orientation, as HF datasets' ``Image()`` decode turns them (where the installed datasets does:
        ``datasets_turns_images``). A plain struct verl opens itself, unturned; ``plain_structs_turned`` (verl 0.5,
        which fails on one, and gets what an ``Image()`` column would give) turns them too."""
        if not datasets_turns_images():
            return [False] * len(plain_structs)
        return [plain_structs_turned or not plain for plain in plain_structs]
