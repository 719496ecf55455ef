#!/bin/bash
# On the GPU machine (repo root, .gpu carried): text rows/s against tokenizer actor counts on its 16 cores (the bare
# ceiling beside them), image rows/s by media layout (CPU pools, GPU vision pool), each consumed by the driver and by
# stand-in workers on streaming_split shards; then the vision pool CPU vs GPU (SKIP_VISION=1: not). Results in $OUT.
set +e
export PYTHONUNBUFFERED=1 RAY_DATA_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
source tools/gpu/setup.sh
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
t "bench scaling"
timeout ${SCALING_TIMEOUT:-330} python3 -m ingest bench scaling --rows ${TEXT_ROWS:-200000} ${IMAGE_ROWS:-3000} \
  --actors ${ACTORS:-1 2 4 8 16} --consumers ${CONSUMERS:-4} --work-dir /tmp/bench >"$OUT"/scaling.json 2>"$OUT"/scaling.err
echo "rc=$?"; grep -E "^(text|images) " "$OUT"/scaling.json | cut -c1-900; tail -3 "$OUT"/scaling.err
[ -n "$SKIP_VISION" ] && { t "end"; exit 0; }
t "bench vision"
timeout ${BENCH_TIMEOUT:-150} python3 -m ingest bench vision --rows 1000 --passes ${PASSES:-10} --gpu-actors ${GPU_ACTORS:-16} \
  --work-dir /tmp/bench >"$OUT"/bench_vision.txt 2>"$OUT"/bench_vision.err
echo "rc=$?"; grep -v "^\s" "$OUT"/bench_vision.txt | head -8; tail -3 "$OUT"/bench_vision.err
t "end"
