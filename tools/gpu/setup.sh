# Sourced by the scripts run on the GPU machine (repo root, .gpu carried): Ray 2.60 and the missing wheels into
# /tmp/site, PYTHONPATH and the model directory set, the parity data's absolute paths made valid; t() logs with time.
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/site
tar xJf .gpu/ray-strip.tar.xz -C /tmp/site || t "ray untar failed"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD INGEST_MODEL_DIR=$PWD/.gpu/model
ORIGIN=$(cat .gpu/origin)  # the parity data name some images by absolute path, under the repo where it was made
[ -e "$ORIGIN/.gpu" ] || { mkdir -p "$ORIGIN" && ln -s "$PWD/.gpu" "$ORIGIN/.gpu"; }
t "setup done; repo at $PWD"
