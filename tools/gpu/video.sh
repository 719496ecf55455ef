#!/bin/bash
# On the GPU machine (from the repo root, .gpu-video carried: tools/gpu/prepare.sh made it; a call of its own, as
# .gpu and .gpu-video together are over what a run can carry): PyAV and torchcodec from their wheels, torchcodec
# given PyAV's FFmpeg (python -m ingest ffmpeg-libdir), then video_check.py (NVDEC against PyAV) and the CUDA video
# tests' function. Results in $OUT. VIDEO_WHEELS: another wheel directory (a dry run on the CPU machine).
set -euo pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
SITE=/tmp/site-video
rm -rf "$SITE" && mkdir -p "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${VIDEO_WHEELS:-.gpu-video}"/*.whl
export PYTHONPATH=$SITE:$PWD
LIBDIR=$("$PY" -c "from ingest.media.video import pyav_ffmpeg_libdir; print(pyav_ffmpeg_libdir())")
echo "FFmpeg from PyAV through $LIBDIR"
export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
OUT=${OUT:-/tmp} timeout "${VIDEO_TIMEOUT:-240}" "$PY" tools/gpu/video_check.py
