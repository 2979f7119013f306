"""Benchmarks: each measures a budget of docs/design.md on servers and workers it starts itself.

Every benchmark starts its workers and then its clients at once: the case of a client started
before its workers, which waits for the serving to be declared instead of failing with
qs.UnknownServing (docs/usage.md). Set here once, for every client and process a benchmark
starts."""

import os

os.environ.setdefault("QUEUESERVE_WAIT_FOR_WORKER", "1")
