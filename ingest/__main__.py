"""``python -m ingest``. The ``bench`` command belongs to the dev tooling (``ingest.devtools``): this entry point is
the one place that hands over to it, so that no product module imports it."""

import sys

if sys.argv[1:2] == ["bench"]:
    from ingest.devtools.cli import main
else:
    from ingest.cli import main

sys.exit(main())
