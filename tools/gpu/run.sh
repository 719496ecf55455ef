#!/bin/bash
# On the GPU machine (from the repo root, .gpu carried: tools/gpu/prepare.sh made it): set up Ray 2.60 and a few
# wheels, then bench vision, an in-process profile, the GPU parity check and the CUDA tests. Results in $OUT.
set +e
export PYTHONUNBUFFERED=1 RAY_DATA_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
source tools/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2; df -h /dev/shm | tail -1
python3 - <<'PY'
import importlib
for m in ["ray", "pyarrow", "numpy", "torch", "torchvision", "transformers", "tokenizers", "PIL", "pandas", "pyspng", "deflate"]:
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "FAILED", e)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import torchcodec; print("torchcodec", torchcodec.__version__)
except Exception as e:
    print("torchcodec not importable:", type(e).__name__)
PY
[ -n "$SKIP_BENCH" ] || { t "bench vision"
timeout ${BENCH_TIMEOUT:-300} python3 -m ingest bench vision --rows 1000 --passes ${PASSES:-20} --gpu-actors ${GPU_ACTORS:-4 8 12 16} --device-resize ${DEVICE_RESIZE:-auto} --work-dir /tmp/bench >"$OUT"/bench_vision.txt 2>"$OUT"/bench_vision.err
echo "rc=$?"; grep -v "^\s" "$OUT"/bench_vision.txt | head -8; tail -5 "$OUT"/bench_vision.err; }
[ -z "$QUICK_CHECK" ] || { t "quick check"; timeout 120 python3 tools/gpu/quick_check.py /tmp/bench/geo3k-1000 2>&1 | grep -v -i warn | tail -4; }
[ -z "$AB_UPLOAD" ] || { t "upload A/B"; timeout 300 python3 tools/gpu/ab_upload.py /tmp/bench/geo3k-1000 2>&1 | grep -v -i "warn\|info" | tail -8; }
[ -n "$ONLY_BENCH" ] && exit 0
t "pytest cuda"
# the gpu-marked tests (their files only: the GPU image lacks what other suites import) and the pixel ops' device paths
timeout ${PYTEST_TIMEOUT:-140} python3 -m pytest -q -p no:cacheprovider -m "${PYTEST_M:-gpu}" tests/test_parity_multimodal.py \
  tests/test_feed.py tests/test_sft_dataset.py tests/media/test_triton_resize.py tests/media/test_video.py >"$OUT"/pytest.txt 2>&1
echo "rc=$?"; tail -12 "$OUT"/pytest.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/media/test_pixels.py \
  -k "${PYTEST_K:-pixel_ops or one_copy or device_patches}" >"$OUT"/pytest_pixels.txt 2>&1
echo "rc=$?"; tail -5 "$OUT"/pytest_pixels.txt
[ -n "$SKIP_PROF" ] || { t "in-process profile"
timeout 90 python3 tools/gpu/prof.py /tmp/bench/geo3k-1000 >"$OUT"/prof.txt 2>"$OUT"/prof.err
echo "rc=$?"; grep -v "Warning\|warn" "$OUT"/prof.txt | head -40; tail -3 "$OUT"/prof.err; }
[ -n "$SKIP_GPU_CHECK" ] && { t "end"; exit 0; }
t "gpu parity check"
timeout ${GPU_CHECK_TIMEOUT:-200} python3 tools/gpu/gpu_check.py "$OUT"/gpu_check.json >"$OUT"/gpu_check.log 2>&1
echo "rc=$?"; grep '^{' "$OUT"/gpu_check.log | cut -c1-2500; grep -v '^{' "$OUT"/gpu_check.log | grep -i "error\|Traceback" | head -5
t "end"
