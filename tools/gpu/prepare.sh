#!/bin/bash
# On the CPU machine, from the repo root, after `make install oracle`: make .gpu/, what tools/gpu/run.sh needs on a
# GPU machine whose Python (3.12) has torch, transformers, pyarrow and pytest but not Ray, and which reaches no
# package index. Ray's wheel (79 MB) is over what a run can carry (64 MiB), so it goes stripped of Java, RLlib,
# Serve, LLM and the dashboard's web client, xz-compressed (~25 MB). Then the model directory, the parity data and
# the verl oracle's fingerprints of its rows.
set -euo pipefail
PY=${PY:-.venv/bin/python}
G=.gpu
mkdir -p "$G/whl" /tmp/gpu-prepare
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "$@"
}
if [ ! -f "$G/ray-strip.tar.xz" ]; then
  download -d /tmp/gpu-prepare ray==2.60.0
  rm -rf /tmp/gpu-prepare/ray-tree && mkdir /tmp/gpu-prepare/ray-tree
  (cd /tmp/gpu-prepare/ray-tree && unzip -q ../ray-2.60.0-*.whl \
    && rm -rf ray/jars ray/rllib ray/serve ray/llm ray/dashboard/client/build \
    && find . -name '*.map' -delete && tar cf - ray ray-2.60.0.dist-info | xz -T2 -9 >"../ray-strip.tar.xz")
  mv /tmp/gpu-prepare/ray-strip.tar.xz "$G/"
fi
# what Ray and the pipeline import that the GPU image lacks (pydantic pins its core)
download -d "$G/whl" pyspng==0.1.4 deflate==0.9.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
rm -rf "$G/model" && cp -a "$("$PY" -c 'from ingest.tokenizer.offline import build_offline_model_dir as b; print(b())')" "$G/model"
# .gpu-video/ for tools/gpu/video.sh, carried in a call of its own (with .gpu it is over 64 MiB): PyAV (its wheel
# bundles FFmpeg, which the GPU image lacks) and the torchcodec for that image's torch 2.11 (0.16; CUDA wheels)
mkdir -p .gpu-video
grep -qx '/.gpu-video/' .git/info/exclude || echo /.gpu-video/ >>.git/info/exclude
download -d .gpu-video av==18.1.0 torchcodec==0.16.0
pwd >"$G/origin"
"$PY" tools/gpu/make_oracle.py
"$PY" tools/gpu/make_oracle_u8.py
du -sh "$G" .gpu-video
