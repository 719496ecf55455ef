"""``python -m ingest``. The ``bench`` command belongs to the dev tooling, the repository's top-level ``tools/``
folder, which no wheel ships: this entry point is the one place that hands over to it, so that no product module
imports it."""

import sys

if sys.argv[1:2] == ["bench"]:
    try:
        from tools.cli import main
    except ModuleNotFoundError as missing:
        if missing.name not in ("tools", "tools.cli"):
            raise
        sys.exit(
            "python -m ingest bench: the benchmarks are dev tooling, not part of the installed package. Run it from a "
            "clone of the repository (its tools/ folder) after `make install oracle`."
        )
else:
    from ingest.cli import main

sys.exit(main())
