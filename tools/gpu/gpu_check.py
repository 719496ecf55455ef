"""On the GPU machine: our rows on cpu (fingerprints vs verl's, computed on the CPU VM), on cuda, and on cuda with
nvJPEG decode, against the cpu rows: every non-pixel leaf equal, pixel differences measured."""

import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
here = ROOT / ".gpu"  # what tools/gpu/prepare.sh made
sys.path.insert(0, str(ROOT))

from ingest import build_dataset  # noqa: E402
from ingest.media.pixels import ImagePixels  # noqa: E402
from ingest.tokenizer.offline import build_offline_model_dir  # noqa: E402
from tests.support.batches import collect  # noqa: E402
from tools.gpu.fingerprint import PIXEL_KEYS, fingerprint, levels  # noqa: E402

BATCH = 8
model = str(build_offline_model_dir())
files = sorted(str(p) for p in (here / "geo3k").glob("*.parquet"))
oracle = pickle.load(open(here / "oracle_fp.pkl", "rb"))
tol = ImagePixels.from_dir(model).device_tolerance()


def ours(config):
    t = time.perf_counter()
    out = collect(build_dataset(files, model, {**config, "shuffle": False}, processor=model), BATCH)
    return out, round(time.perf_counter() - t, 2)


def is_pixel(path):
    return any(f".{k}" in path for k in PIXEL_KEYS)


def pixel_stats(a, b):
    diffs, shapes_equal = [], True
    for x, y in zip(a, b, strict=True):
        for mx, my in zip(x.get("multi_modal_inputs", ()), y.get("multi_modal_inputs", ()), strict=True):
            for k in PIXEL_KEYS:
                if k in my:
                    if mx[k].shape != my[k].shape:
                        shapes_equal = False
                        continue
                    diffs.append((mx[k].float().cpu() - my[k].float()).abs().flatten())
    if not diffs:
        return {"shapes_equal": shapes_equal}
    d = torch.cat(diffs)
    return {
        "shapes_equal": shapes_equal,
        "values": d.numel(),
        "max": float(d.max()),
        "mean": float(d.mean()),
        "frac_gt_1e-4": float((d > 1e-4).float().mean()),
        "within_device_tolerance": bool(d.max() <= tol),
    }


def image_stats(a, b):
    diffs = []
    for x, y in zip(a, b, strict=True):
        for dx, dy in zip(x["multi_modal_data"], y["multi_modal_data"], strict=True):
            for p, q in zip(dx.get("image", []), dy.get("image", []), strict=True):
                if p.size != q.size:
                    return {"sizes_equal": False}
                diffs.append(np.abs(np.asarray(p, np.int16) - np.asarray(q, np.int16)).ravel())
    if not diffs:
        return {}
    d = np.concatenate(diffs)
    return {
        "sizes_equal": True,
        "max_levels": int(d.max()),
        "mean_levels": float(d.mean()),
        "frac_nonzero": float((d > 0).mean()),
    }


def per_image_stats(a, b):
    """For images that differ: per-image mean and max level differences (largest first)."""
    stats = []
    for x, y in zip(a, b, strict=True):
        for dx, dy in zip(x["multi_modal_data"], y["multi_modal_data"], strict=True):
            for p, q in zip(dx.get("image", []), dy.get("image", []), strict=True):
                d = np.abs(np.asarray(p, np.int16) - np.asarray(q, np.int16))
                if d.any():
                    stats.append((round(float(d.mean()), 3), int(d.max()), p.size))
    stats.sort(reverse=True)
    return {
        "images_differing": len(stats),
        "top_by_mean": stats[:8],
        "max_of_max": max((s[1] for s in stats), default=0),
    }


def oracle_levels(batches):
    pixels = ImagePixels.from_dir(model)
    ours = [levels(mi["pixel_values"], pixels) for b in batches for mi in b["multi_modal_inputs"]]
    npz = np.load(here / "oracle_u8.npz")
    theirs = [npz[f"arr_{k}"] for k in range(len(npz.files))]
    pairs = zip(ours, theirs, strict=True)
    d = np.concatenate([np.abs(a.astype(np.int16) - b.astype(np.int16)).ravel() for a, b in pairs])
    return {
        "values": int(d.size),
        "differing": int((d > 0).sum()),
        "max_levels": int(d.max()),
        "mean_levels": float(d.mean()),
    }


def leaf_mismatches(fa, fb, skip):
    bad = [p for p in set(fa) | set(fb) if not skip(p) and fa.get(p) != fb.get(p)]
    return {"count": len(bad), "first": sorted(bad)[:5]}


import os  # noqa: E402

import ray  # noqa: E402

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # cpu: a dry run of this script on the CPU VM
ray.init(address="local", num_gpus=1, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
report = {"torch": torch.__version__, "gpu": gpu_name, "device_tolerance": tol, "configs": []}
gpu = {"vision_num_gpus": 1, "vision_device": DEVICE}
for entry in oracle:
    config = entry["config"]
    cpu, t_cpu = ours(config)
    fp_cpu = fingerprint(cpu)
    r = {"config": config, "rows": sum(len(b["input_ids"]) for b in cpu), "oracle_rows": entry["rows"]}
    r["cpu_vs_verl_all_leaves"] = leaf_mismatches(fp_cpu, entry["fingerprint"], lambda p: False)
    r["cpu_vs_verl_non_pixel"] = leaf_mismatches(fp_cpu, entry["fingerprint"], is_pixel)
    if config == oracle[0]["config"]:
        r["cpu_vs_verl_levels"] = oracle_levels(cpu)
    for name, extra in (("cuda", gpu), ("cuda+jpeg", {**gpu, "vision_decode_jpeg_on_device": True})):
        out, secs = ours({**config, **extra})
        fp = fingerprint(out)
        skip = is_pixel if name == "cuda" else (lambda p: is_pixel(p) or ".multi_modal_data" in p)
        r[name] = {
            "non_pixel_vs_cpu": leaf_mismatches(fp, fp_cpu, skip),
            "pixel_values_vs_cpu": pixel_stats(out, cpu),
            "seconds": secs,
        }
        if name == "cuda+jpeg":
            r[name]["images_vs_cpu"] = image_stats(out, cpu)
            r[name]["per_image"] = per_image_stats(out, cpu)
            r[name]["multi_modal_data_structure"] = leaf_mismatches(
                fp, fp_cpu, lambda p: is_pixel(p) or not p.endswith((".keys", ".len"))
            )
    r["cpu_seconds"] = t_cpu
    report["configs"].append(r)
    print(json.dumps(r), flush=True)
json.dump(report, open(sys.argv[1] if len(sys.argv) > 1 else "gpu_check.json", "w"), indent=1)
