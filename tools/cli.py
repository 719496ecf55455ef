"""``python -m ingest bench ...``: the benchmarks, against verl on the same data (``ingest/__main__.py`` hands the
``bench`` command here; the product's CLI never imports this package)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def cmd_bench(args: argparse.Namespace) -> int:
    from tools.bench import MM_LAYOUTS, bench_mm, bench_text

    if args.kind == "sft":  # SFT samples/s: build_sft_dataset vs renderers' own loop (default 20000, text)
        from tools.sft_bench import bench_sft

        result = bench_sft(rows=args.rows or [20_000], work_dir=args.work_dir, workloads=args.sft_workload)
        print(json.dumps(result, indent=2))
        return 0
    if args.kind == "scale":  # peak memory (Ray processes + object store) and rows/s at each size, default 100k 1M
        from tools.scale import bench_scale  # --images: image rows, default 10k 100k

        print(json.dumps(bench_scale(rows=args.rows, work_dir=args.work_dir, images=args.images), indent=2))
        return 0
    if args.kind == "scaling":  # text rows/s by tokenizer actor count, image rows/s by layout (--rows: text, images)
        from tools.scaling import bench_scaling

        text_rows, image_rows = ((args.rows or []) + [200_000, 2_000][len(args.rows or []) :])[:2]
        result = bench_scaling(text_rows, image_rows, args.actors, args.work_dir, consumers=args.consumers)
        print(json.dumps(result, indent=2))
        return 0
    if args.kind == "profile":  # a row's CPU time per stage, one process, no Ray (--rows: 200000 text, 1000 images)
        from tools.profile import bench_profile, bench_profile_images

        if args.images:
            result = bench_profile_images(rows=(args.rows or [1000])[0], work_dir=args.work_dir)
        else:
            result = bench_profile(rows=(args.rows or [200_000])[0], work_dir=args.work_dir)
        print(json.dumps(result, indent=2))
        return 0
    if args.kind == "handoff":  # verl 0.9.1's agent loop, stock vs media_handoff (--rows: prompts, default 2000)
        from tools.handoff_bench import bench_handoff

        result = bench_handoff(
            rows=(args.rows or [2000])[0],
            runs=args.runs,
            batch_size=args.batch_size,
            work_dir=args.work_dir,
            workload=args.workload,
            paths=tuple(args.path),
        )
        print(json.dumps(result, indent=2))
        return 0
    if args.kind == "verl09":  # verl 0.9.1 vs row_format verl-0.9 (or --row-format verl-0.7: 0.7.1), cold
        from tools.verl09_bench import bench_verl09  # --rows: text rows, image rows

        text_rows, image_rows = (args.rows or [200_000, 5_000]) + [0] * (2 - len(args.rows or [0, 0]))
        result = bench_verl09(text_rows, image_rows, work_dir=args.work_dir, row_format=args.row_format)
        print(json.dumps(result, indent=2))
        return 0
    if args.kind == "refs":  # rollout feeding: object refs vs by value (--rows: one size, default 20000)
        from tools.bench import bench_refs

        print(json.dumps(bench_refs(rows=(args.rows or [20_000])[0], work_dir=args.work_dir), indent=2))
        return 0
    if args.kind == "vision":  # images/s of the vision pool alone: 2-core CPU pool vs a GPU actor (default 1000)
        from tools.vision_bench import SHARED_GPU_ACTORS, bench_vision

        result = bench_vision(
            rows=(args.rows or [1000])[0],
            work_dir=args.work_dir,
            passes=args.passes,
            gpu_actors=tuple(args.gpu_actors or SHARED_GPU_ACTORS),
            device_resizes=tuple(args.device_resize),
        )
        print(json.dumps(result, indent=2))
        return 0
    if args.kind == "mm":
        result = bench_mm(
            rows=args.rows or [1000],
            work_dir=args.work_dir,
            skip_verl=args.skip_verl,
            warm_workers=args.warm_workers,
            layouts=args.layouts or tuple(MM_LAYOUTS),
        )
    else:
        result = bench_text(rows=args.rows or [20_000, 200_000], work_dir=args.work_dir, skip_verl=args.skip_verl)
    print(json.dumps(result, indent=2))
    if args.record:
        from tools.chart import record

        print(f"recorded; chart: {record(args.kind, result)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ingest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmark against verl 0.5.0 on the same data")
    bench.add_argument(
        "kind", choices=["text", "mm", "refs", "sft", "scale", "vision", "verl09", "handoff", "scaling", "profile"]
    )
    bench.add_argument("--rows", type=int, nargs="+", help="dataset sizes (text: 20000 200000, mm: 1000)")
    bench.add_argument("--work-dir", default=None)
    bench.add_argument("--actors", type=int, nargs="+", help="scaling only: tokenizer actor counts (1 2 4 8 16)")
    bench.add_argument(
        "--consumers", type=int, default=4, help="scaling only: stand-in workers taking streaming_split shards"
    )
    bench.add_argument("--skip-verl", action="store_true")
    bench.add_argument("--runs", type=int, default=1, help="handoff only: runs of both sides, one after another")
    bench.add_argument(
        "--batch-size", type=int, default=128, help="handoff only: prompts per step (each side holds a step's samples)"
    )
    bench.add_argument(
        "--workload",
        default="geo3k",
        choices=["geo3k", "mixed"],
        help="handoff only: geo3k-shaped prompts, or the mixed workload (Image() and plain-struct columns, JPEG and "
        "PNG, 28 px to over 2,000 px, several images a prompt, frame-list videos)",
    )
    bench.add_argument(
        "--sft-workload",
        nargs="+",
        default=["text"],
        choices=["text", "qwen3-vl"],
        help="sft only: chats through renderers' Qwen3 renderer, or with images through its Qwen3-VL renderer",
    )
    bench.add_argument(
        "--path",
        nargs="+",
        default=["legacy"],
        choices=["legacy", "v1"],
        help="handoff only: verl 0.9's legacy agent-loop worker, its v1 (TransferQueue) worker, or both",
    )
    bench.add_argument(
        "--row-format",
        default="verl-0.9",
        choices=["verl-0.7", "verl-0.9"],
        help="verl09 only: our rows in this format against its verl release (verl-0.7: verl 0.7.1)",
    )
    bench.add_argument(
        "--images",
        action="store_true",
        help="scale / profile: geo3k-shaped image rows (scale: default 10000 100000; profile: 1000), not text",
    )
    bench.add_argument(
        "--record",
        action="store_true",
        help="text / mm: keep the result in docs/bench-results/ and redraw docs/benchmarks.png from every record",
    )
    bench.add_argument("--passes", type=int, default=1, help="vision only: each pool goes over the blocks N times")
    bench.add_argument(
        "--gpu-actors", type=int, nargs="+", help="vision only: the 'cuda xK' pools, K actors sharing the GPU (2 4)"
    )
    bench.add_argument(
        "--device-resize",
        nargs="+",
        default=["auto"],
        choices=["auto", "torch", "triton"],  # ingest.config.DEVICE_RESIZES
        help="vision only: the GPU pools' image resize (vision_device_resize); each after the first runs those "
        "pools again (auto: triton where it runs)",
    )
    bench.add_argument(
        "--layouts",
        nargs="+",
        help="mm only: our layouts to run, in this order (one_pool decode_in_tokenizer decode_pool)",
    )
    bench.add_argument(
        "--warm-workers",
        action="store_true",
        help="mm only, a diagnostic: our actors start in prestarted workers that imported Ray Data and torch",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
