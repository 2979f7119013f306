"""Servings for tests/integration/test_protocol_doc_facts.py, importable by a worker process as
``tests.support.protocol_app:NAME``."""

from __future__ import annotations

import queueserve as qs
from tests.support.servings import fail_on_negative

# A batch that raises fails whole: every item of it gets the one error (docs/protocol.md).
failing = qs.Serving(
    fail_on_negative, name="failing", batch_size=8, batch_timeout=0.01, on_error="fail"
)
