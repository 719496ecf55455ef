"""``python -m ingest``: run the pipeline, build the offline tokenizer, write the demo dataset. (``bench`` is the
dev tooling's, in the repository's ``tools/``.)"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ingest.demo import DEFAULT_SAMPLE_ROWS, ensure_sample
from ingest.errors import IngestError, find_ingest_error


def load_run_config(path: str | None) -> tuple[dict, dict]:
    """(data section, run section) from a YAML file: a verl config (``data:`` section) or flat data keys.

    Run keys (top level): ``files``, ``tokenizer``, ``processor``, ``output``, ``quarantine_dir``; verl's
    ``data.train_files`` / ``data.tokenizer`` and
    ``actor_rollout_ref.model.path`` are read too.
    """
    if not path:
        return {}, {}
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise IngestError(f"config {path} must be a YAML mapping")
    data = dict(doc.get("data") or {}) if "data" in doc else {k: v for k, v in doc.items() if k not in RUN_KEYS}
    run = {k: doc[k] for k in RUN_KEYS if k in doc}
    if "files" not in run and data.get("train_files"):
        run["files"] = data["train_files"]
    if "tokenizer" not in run:
        model_path = ((doc.get("actor_rollout_ref") or {}).get("model") or {}).get("path")
        run["tokenizer"] = data.get("tokenizer") or model_path
    return data, run


RUN_KEYS = ("files", "tokenizer", "processor", "output", "quarantine_dir")


def cmd_run(args: argparse.Namespace) -> int:
    from ingest.run import run_pipeline, write_summary_json
    from ingest.tokenizer.offline import EMBEDDED_NAME

    data, run = load_run_config(args.config)
    files = args.files or run.get("files")
    if not files:
        files = ensure_sample()
        print(f"[ingest] no --files: using the embedded sample ({len(files)} files, {DEFAULT_SAMPLE_ROWS:,} rows)")
    tokenizer = args.tokenizer or run.get("tokenizer") or EMBEDDED_NAME
    output = args.output or run.get("output")
    processor = args.processor or run.get("processor")
    summary = run_pipeline(
        files,
        None if tokenizer == EMBEDDED_NAME else tokenizer,
        data,
        processor=processor,
        output=output,
        quarantine_dir=args.quarantine_dir or run.get("quarantine_dir"),
    )
    print(summary.format())
    print("INGEST_SUMMARY " + json.dumps(summary.to_dict()))
    if args.summary_json:
        write_summary_json(summary, args.summary_json)
    return 0


def cmd_make_tokenizer(args: argparse.Namespace) -> int:
    from ingest.tokenizer.offline import build_offline_model_dir

    print(build_offline_model_dir(args.out, force=args.force))
    return 0


def cmd_ffmpeg_libdir(args: argparse.Namespace) -> int:
    from ingest.media.video import pyav_ffmpeg_libdir

    print(pyav_ffmpeg_libdir(args.dest))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from ingest.demo import write_gsm8k_parquet

    paths = write_gsm8k_parquet(
        args.out, args.rows, num_files=args.files, variety=args.variety, long_every=args.long_every
    )
    print("\n".join(paths))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ingest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="stream the dataset through the pipeline (no arguments: the embedded demo)")
    run.add_argument("config", nargs="?", help="YAML: a verl config (its data: section) or flat data keys")
    run.add_argument("--files", nargs="+", help="Parquet paths, directories or globs (local, s3://, hdfs://)")
    run.add_argument("--tokenizer", help="model directory or hub name (default: the embedded offline Qwen2-VL)")
    run.add_argument("--processor", help="processor directory or hub name: the multimodal path (embedded:qwen2-vl)")
    run.add_argument("--output", help="write the processed rows as Parquet under this directory")
    run.add_argument("--quarantine-dir", help="where quarantine.parquet goes (default: --output)")
    run.add_argument("--summary-json", help="also write the run summary as JSON here")
    run.set_defaults(func=cmd_run)

    tok = sub.add_parser("make-tokenizer", help="build the offline Qwen2-VL tokenizer+processor from dashscope")
    tok.add_argument("--out", help="directory (default: the cache directory the pipeline uses)")
    tok.add_argument("--force", action="store_true")
    tok.set_defaults(func=cmd_make_tokenizer)

    ffmpeg = sub.add_parser(
        "ffmpeg-libdir",
        help="print a directory that lends torchcodec PyAV's FFmpeg libraries (for LD_LIBRARY_PATH)",
    )
    ffmpeg.add_argument("--dest", help="make it here (default: under the temp directory, one per PyAV install)")
    ffmpeg.set_defaults(func=cmd_ffmpeg_libdir)

    sample = sub.add_parser("sample", help="generate gsm8k-shaped Parquet files")
    sample.add_argument("out")
    sample.add_argument("--rows", type=int, default=DEFAULT_SAMPLE_ROWS)
    sample.add_argument("--files", type=int, default=4)
    sample.add_argument("--long-every", type=int, default=100, help="every k-th prompt is overlong (0: none)")
    sample.add_argument("--variety", action="store_true", help="system / multi-turn / unicode / kwargs rows")
    sample.set_defaults(func=cmd_sample)

    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ingest").setLevel(logging.INFO)  # the run's own choices (media layout, epoch count)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:
        err = find_ingest_error(exc)
        if err is None:
            raise
        print(f"ingest: error: {err}", file=sys.stderr)
        return 2
