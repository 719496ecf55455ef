"""Videos as verl 0.5.0 sees them: ``qwen_vl_utils.fetch_video`` sampling and sizing rules, without its readers.

verl's ``process_video`` takes a dict ``{"video": PATH | [FRAME, ...], "fps"?, "nframes"?, "min_frames"?, ...}`` and
calls ``fetch_video`` (qwen-vl-utils 0.0.14 in the oracle environment). The rules ported here:

- a file: ``total_frames`` and the average fps from the container, an optional ``video_start`` / ``video_end`` range,
  ``nframes`` = 2 fps clamped to 4..768 (and to the frame count), rounded down to an even count, frame indices
  ``linspace(start, end, nframes).round()``;
- a frame list: every frame through ``fetch_image`` (RGBA composited on white, resized with the 56-pixel factor that
  0.0.14 passes there), padded to an even count by repeating the last frame;
- then one resize of all frames (torchvision bicubic, antialiased) to ``smart_resize`` of the frame size with factor
  28 inside the video pixel budget (128..768 tokens per frame, ``total_pixels / nframes * 2``).

The tokenize stage needs only the frame count and the final size to know how many pad tokens a video expands to;
``probe_video`` gets them from headers (container metadata, image headers). Decoding: PyAV (FFmpeg) for files, PIL for
frames; video files left to the vision stage (``vision_decode_video_on_device``) may decode with torchcodec instead
(``vision_video_decoder``). ``multi_modal_data["video"]`` is the resized ``(T, 3, H, W)`` array as float32, as verl
hands it on; the values are whole numbers (resized uint8), so blocks carry uint8 and the consumer converts.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ingest.config import VIDEO_DECODERS
from ingest.media.image import read_image_bytes

FPS = 2.0
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_TOKENS = 128
VIDEO_MAX_TOKENS = 768
IMAGE_MIN_TOKENS = 4
IMAGE_MAX_TOKENS = 16384
MAX_RATIO = 200
PATCH_SIZE = 14
SPATIAL_MERGE = 2
MODEL_SEQ_LEN = int(float(os.environ.get("MODEL_SEQ_LEN", 128000)))  # qwen-vl-utils reads the same variable

VIDEO_FORMAT_HELP = (
    'a video must be a dict {"video": "path/to/video.mp4" | ["frame1.jpg", ...], optional fps / nframes / '
    "min_frames / max_frames / min_pixels / max_pixels / total_pixels / video_start / video_end}"
)


def _round(n: float, f: int) -> int:
    return round(n / f) * f


def _ceil(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def _floor(n: float, f: int) -> int:
    return math.floor(n / f) * f


def qwen_smart_resize(
    height: int, width: int, factor: int, min_pixels: float | None = None, max_pixels: float | None = None
) -> tuple[int, int]:
    """qwen-vl-utils' ``smart_resize`` (not transformers': a ``factor`` floor on the rounded sides, image defaults)."""
    max_pixels = max_pixels if max_pixels is not None else IMAGE_MAX_TOKENS * factor**2
    min_pixels = min_pixels if min_pixels is not None else IMAGE_MIN_TOKENS * factor**2
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar = max(factor, _round(height, factor))
    w_bar = max(factor, _round(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar, w_bar = _floor(height / beta, factor), _floor(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = _ceil(height * beta, factor), _ceil(width * beta, factor)
    return h_bar, w_bar


def smart_nframes(options: dict, total_frames: int, video_fps: float) -> int:
    if "fps" in options and "nframes" in options:
        raise ValueError("a video takes either fps or nframes, not both")
    if "nframes" in options:
        nframes = _round(options["nframes"], FRAME_FACTOR)
    else:
        fps = options.get("fps", FPS)
        min_frames = _ceil(options.get("min_frames", FPS_MIN_FRAMES), FRAME_FACTOR)
        max_frames = _floor(options.get("max_frames", min(FPS_MAX_FRAMES, total_frames)), FRAME_FACTOR)
        nframes = total_frames / video_fps * fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = _floor(nframes, FRAME_FACTOR)
    if not FRAME_FACTOR <= nframes <= total_frames:
        raise ValueError(f"nframes should be in [{FRAME_FACTOR}, {total_frames}], got {nframes}")
    return nframes


def frame_range(options: dict, total_frames: int, video_fps: float) -> tuple[int, int, int]:
    """(first, last, count) of the frames inside ``video_start`` .. ``video_end`` (seconds)."""
    if video_fps <= 0 or total_frames <= 0:
        raise ValueError(f"video has {total_frames} frames at {video_fps} fps")
    start, end = options.get("video_start"), options.get("video_end")
    if start is None and end is None:
        return 0, total_frames - 1, total_frames
    duration = total_frames / video_fps
    first = math.ceil(max(0.0, min(start, duration)) * video_fps) if start is not None else 0
    last = (
        min(math.floor(max(0.0, min(end, duration)) * video_fps), total_frames - 1)
        if end is not None
        else total_frames - 1
    )
    if first >= last:
        raise ValueError(f"empty video range {start}..{end} s of a {duration:.2f} s video")
    return first, last, last - first + 1


def frame_indices(options: dict, total_frames: int, video_fps: float) -> list[int]:
    import torch  # torch's float32 linspace + round-half-even, exactly as fetch_video samples

    first, last, count = frame_range(options, total_frames, video_fps)
    nframes = smart_nframes(options, count, video_fps)
    return torch.linspace(first, last, nframes).round().long().tolist()


def video_size(nframes: int, height: int, width: int, options: dict, patch_size: int = PATCH_SIZE) -> tuple[int, int]:
    """fetch_video's final (height, width) for ``nframes`` frames of ``height`` x ``width`` (``patch_size``: the
    ``image_patch_size`` its caller passes; verl 0.9 passes the processor's, 16 for Qwen3-VL)."""
    factor = patch_size * SPATIAL_MERGE
    min_pixels = options.get("min_pixels", VIDEO_MIN_TOKENS * factor * factor)
    total_pixels = options.get("total_pixels", MODEL_SEQ_LEN * factor * factor * 0.9)
    max_pixels = max(
        min(VIDEO_MAX_TOKENS * factor * factor, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05)
    )
    max_pixels = min(options.get("max_pixels", max_pixels), max_pixels)
    if "resized_height" in options and "resized_width" in options:
        return qwen_smart_resize(options["resized_height"], options["resized_width"], factor)
    return qwen_smart_resize(height, width, factor, min_pixels, max_pixels)


def frame_image_size(width: int, height: int, options: dict, patch_size: int = PATCH_SIZE) -> tuple[int, int]:
    """(width, height) ``fetch_image`` resizes one list frame to (qwen-vl-utils 0.0.14 passes twice the patch size
    as the patch size there: 28 for 14)."""
    factor = patch_size * SPATIAL_MERGE * SPATIAL_MERGE
    if "resized_height" in options and "resized_width" in options:
        h, w = qwen_smart_resize(options["resized_height"], options["resized_width"], factor)
    else:
        min_pixels = options.get("min_pixels", IMAGE_MIN_TOKENS * factor**2)
        max_pixels = options.get("max_pixels", IMAGE_MAX_TOKENS * factor**2)
        h, w = qwen_smart_resize(height, width, factor, min_pixels, max_pixels)
    return w, h


# --- one video of a row: where it is, what sampling it asks for ----------------------------------------------------


@dataclass
class VideoPlan:
    """What the decode stage needs, found from headers: sources, frame indices, per-frame and final sizes."""

    is_file: bool
    data: list[bytes]  # the file's bytes, or each frame's encoded bytes
    indices: list[int]  # frames to take (file: decoded frame numbers; list: positions, last repeated to pad)
    frame_width: int  # list frames: size after fetch_image; files: the stream's size
    frame_height: int
    height: int  # final size of every frame
    width: int
    metadata: dict  # a blocks.VIDEO_METADATA_STRUCT record (``video_metadata``), less the reader's name

    @property
    def nframes(self) -> int:
        return len(self.indices)

    def as_record(self) -> dict:
        return {
            "is_file": self.is_file,
            "data": self.data,
            "indices": self.indices,
            "frame_width": self.frame_width,
            "frame_height": self.frame_height,
            "height": self.height,
            "width": self.width,
            "metadata": self.metadata,
        }


def video_metadata(record: dict) -> dict:
    """The metadata dict fetch_video returns for one video, from its ``blocks.VIDEO_METADATA_STRUCT`` record: a file's
    frame count is an int and names its reader; a frame list's count is the float its stand-in computes."""
    out = {"fps": record["fps"], "frames_indices": list(record["frames_indices"])}
    if record["from_file"]:
        return {**out, "total_num_frames": int(record["total_num_frames"]), "video_backend": record["video_backend"]}
    return {**out, "total_num_frames": record["total_num_frames"]}


def video_options(value) -> tuple[object, dict]:
    """(source, options) of one video value; raises ``ValueError`` for anything ``process_video`` rejects."""
    if not isinstance(value, dict) or value.get("video") is None:
        raise ValueError(VIDEO_FORMAT_HELP)
    options = {k: v for k, v in value.items() if k not in ("video", "type") and v is not None}
    return value["video"], options


def _open_container(data: bytes):
    import av

    return av.open(io.BytesIO(data), mode="r")


def probe_video(value, storage_options: dict | None = None, patch_size: int = PATCH_SIZE) -> VideoPlan:
    """Plan one video from headers only (container metadata, image headers): no pixel is decoded. ``patch_size``:
    the ``image_patch_size`` fetch_video is called with."""
    source, options = video_options(value)
    factor_size = None
    if isinstance(source, str):
        data = read_image_bytes(source, storage_options)
        if not data:
            raise ValueError(f"video file is empty: {source}")
        with _open_container(data) as container:
            stream = container.streams.video[0]
            total, fps = stream.frames, float(stream.average_rate or 0)
            width, height = stream.codec_context.width, stream.codec_context.height
            if total <= 0:  # no frame count in the header: count packets (no decoding)
                total = sum(1 for p in container.demux(stream) if p.size)
        indices = frame_indices(options, total, fps)
        plan_data, frame_w, frame_h = [data], width, height
        counted = frame_range(options, total, fps)[2]
        metadata = {"fps": fps, "frames_indices": indices, "total_num_frames": float(counted), "from_file": True}
    elif isinstance(source, list | tuple):
        if not source:
            raise ValueError("video frame list is empty")
        from ingest.media.image import image_size

        plan_data = [read_image_bytes(frame, storage_options) for frame in source]
        sizes = {frame_image_size(*image_size(b), options, patch_size) for b in plan_data}
        if len(sizes) != 1:
            raise ValueError(f"video frames resize to different sizes {sorted(sizes)} (verl cannot stack them)")
        ((frame_w, frame_h),) = sizes
        nframes = _ceil(len(plan_data), FRAME_FACTOR)
        indices = list(range(len(plan_data))) + [len(plan_data) - 1] * (nframes - len(plan_data))
        factor_size = (frame_h, frame_w)
        # fetch_video's stand-in metadata for a frame list: positions, a clock from sample_fps / raw_fps
        sample_fps = float(options.get("sample_fps", FPS))
        raw_fps = float(options.get("raw_fps", sample_fps))
        metadata = {
            "fps": raw_fps,
            "frames_indices": list(range(nframes)),
            "total_num_frames": nframes / sample_fps * raw_fps,
            "from_file": False,
        }
    else:
        raise ValueError(VIDEO_FORMAT_HELP)
    h, w = factor_size or (frame_h, frame_w)
    height, width = video_size(len(indices), h, w, options, patch_size)
    return VideoPlan(isinstance(source, str), plan_data, indices, frame_w, frame_h, height, width, metadata)


def decode_video_frames(plan: dict) -> np.ndarray:
    """The sampled frames, (T, H, W, 3) uint8 at their decoded size (file) or fetch_image size (frame list)."""
    if plan["is_file"]:
        wanted = plan["indices"]
        needed = set(wanted)
        frames: dict[int, np.ndarray] = {}
        with _open_container(plan["data"][0]) as container:
            for number, frame in enumerate(container.decode(video=0)):
                if number in needed:
                    frames[number] = frame.to_ndarray(format="rgb24")
                if number >= wanted[-1]:
                    break
        missing = needed - frames.keys()
        if missing:
            raise ValueError(f"video has fewer frames than its header says (missing {sorted(missing)[:5]})")
        return np.stack([frames[i] for i in wanted])
    from PIL import Image

    size = (plan["frame_width"], plan["frame_height"])
    decoded = []
    for data in plan["data"]:
        with Image.open(io.BytesIO(data)) as image:
            decoded.append(np.asarray(_to_rgb(image).resize(size)))
    return np.stack([decoded[i] for i in plan["indices"]])


# where PyAV's wheel keeps its FFmpeg libraries under hashed names (auditwheel), beside the ``av`` package
_SONAME = re.compile(r"(lib(?:av[a-z]+|sw[a-z]+|postproc))-[0-9a-f]{8}(\.so\.\d+)(?:\.\d+)*")


@functools.cache
def torchcodec_error() -> str | None:
    """Why torchcodec's video decoder does not load here, or None where it does. It needs FFmpeg's shared libraries
    and a build that matches this torch (its native libraries raise ``RuntimeError`` / ``OSError`` then, not only
    ``ImportError``)."""
    try:
        import torchcodec.decoders  # noqa: F401
        from torchcodec._core import ops
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}"
    # from 0.17 the import goes on without FFmpeg (its image decoders do not need it) and says so here
    if not getattr(ops, "_FFMPEG_AVAILABLE", True):
        return "it found no FFmpeg libraries it can load, of FFmpeg 4 to 9"
    return None


def torchcodec_loads() -> bool:
    """Whether torchcodec imports here (see ``torchcodec_error``)."""
    return torchcodec_error() is None


def video_file_decoder(device: str, choice: str = "auto") -> str:
    """Which decoder ``decode_video_file`` uses on ``device`` for ``choice`` (one of ``VIDEO_DECODERS``): "auto" is
    ``torchcodec`` (NVDEC) on CUDA where torchcodec loads, else ``pyav`` (the decode stage's CPU decoder). An explicit
    "torchcodec" that does not load is an error saying why and how to give it FFmpeg."""
    if choice not in VIDEO_DECODERS:
        raise ValueError(f"vision_video_decoder must be one of {VIDEO_DECODERS}, got {choice!r}")
    if choice == "torchcodec":
        if not torchcodec_loads():
            raise RuntimeError(
                f"vision_video_decoder: torchcodec, but torchcodec does not load here ({torchcodec_error()}). Install "
                "the torchcodec that matches this torch, and FFmpeg's shared libraries or PyAV's: start the processes "
                "that decode (`ray start`, the driver) with LD_LIBRARY_PATH=$(python -m ingest ffmpeg-libdir)"
            )
        return "torchcodec"
    if choice == "pyav":
        return "pyav"
    # by its name: a CPU vision actor imports no torch (tests/test_parity_multimodal.py)
    return "torchcodec" if str(device).startswith("cuda") and torchcodec_loads() else "pyav"


def decode_video_file(data: bytes, indices: list[int], device: str = "cpu", decoder: str = "auto"):
    """The frames at ``indices`` of an encoded video file, as a (T, 3, H, W) uint8 tensor on ``device``.

    torchcodec (``video_file_decoder``; NVDEC on CUDA): its decoder on the device, frames by index after a scan of the
    file (``exact`` seek mode: frame i is the i-th frame in presentation order, as PyAV decodes them; on the CPU with
    the same FFmpeg the frames are PyAV's, bit for bit). PyAV: on the CPU, exactly ``decode_video_frames``, then one
    upload."""
    import torch

    if video_file_decoder(device, decoder) == "torchcodec":
        from torchcodec.decoders import VideoDecoder

        video = VideoDecoder(data, device=device, seek_mode="exact")
        if indices and max(indices) >= len(video):
            raise ValueError(f"video has fewer frames than its header says ({len(video)}, need {max(indices) + 1})")
        return video.get_frames_at(list(indices)).data
    frames = decode_video_frames({"is_file": True, "data": [data], "indices": list(indices)})
    return torch.from_numpy(frames).permute(0, 3, 1, 2).to(device)


def pyav_ffmpeg_libdir(dest: str | os.PathLike | None = None) -> str:
    """A directory through which torchcodec finds the FFmpeg that PyAV's wheel bundles, for machines without FFmpeg's
    shared libraries: links under the names torchcodec asks for (``libavcodec.so.62``, ...), and under their own
    hashed names, which the libraries load each other by (``$ORIGIN`` is the directory a library was found in, so
    the links must sit together). Put it on ``LD_LIBRARY_PATH`` of the processes that decode, before they start:
    the loader reads that variable once. Idempotent; by default under the temp directory, one per PyAV install."""
    import av

    libs = Path(av.__file__).resolve().parent.parent / "av.libs"
    if not libs.is_dir():
        raise RuntimeError(f"this PyAV ({av.__version__}) bundles no FFmpeg libraries ({libs} is missing)")
    if dest is None:
        digest = hashlib.sha256(str(libs).encode()).hexdigest()[:12]
        dest = Path(tempfile.gettempdir()) / f"ingest-ffmpeg-{av.__version__}-{digest}"
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for lib in sorted(libs.iterdir()):
        match = _SONAME.fullmatch(lib.name)
        for name in [lib.name] + ([match[1] + match[2]] if match else []):
            link = dest / name
            if not (link.is_symlink() and os.readlink(link) == str(lib)):
                tmp = dest / f".{name}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                os.symlink(lib, tmp)
                os.replace(tmp, link)  # atomic: processes building the same directory at once do not trip
    return str(dest)


def _to_rgb(image):
    """qwen-vl-utils ``to_rgb``: RGBA composited on white, everything else ``convert("RGB")``."""
    from PIL import Image

    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def resize_frames(frames, height: int, width: int, device: str = "cpu"):
    """(T, H, W, 3) uint8 array, or a (T, 3, H, W) uint8 tensor (frames decoded on the device) -> (T, 3, height,
    width) uint8 torch tensor on ``device``: fetch_video's bicubic antialiased resize."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    if isinstance(frames, torch.Tensor):
        video = frames.to(device)
    else:
        video = torch.as_tensor(frames).permute(0, 3, 1, 2).to(device)
    return F.resize(video, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)
