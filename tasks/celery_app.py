"""The Celery app that triggers indexing: Redis as broker and result backend.

Run a worker with ``celery -A tasks.celery_app worker --pool solo``. Configuration is read from
the environment when the app is first used, never at import:

- ``QUEUESERVE_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``): the Redis of queueserve,
  and of Celery too unless ``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` say otherwise
  (Celery reads those two itself). ``unix://`` URLs are translated to Celery's
  ``redis+socket://`` form.
- ``QUEUESERVE_PREFIX`` (default ``qs``): Celery's keys go under ``<prefix>:celery:``, beside
  queueserve's, so one namespace holds everything a deployment (or a test) writes.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qs, urlsplit

from celery import Celery

from . import indexing

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
INDEX_TASK = "tasks.index_corpus"
SEARCH_TASK = "tasks.search"
SUBMIT_TASK = "tasks.submit_index"
STATUS_TASK = "tasks.index_status"
COLLECT_TASK = "tasks.collect_index"


def celery_redis_url(url: str) -> str:
    """A redis-py URL in the form Celery's broker and backend accept: ``unix:///s.sock?db=2``
    becomes ``redis+socket:///s.sock?virtual_host=2``; other URLs pass unchanged."""
    parts = urlsplit(url)
    if parts.scheme != "unix":
        return url
    db = parse_qs(parts.query).get("db", ["0"])[0]
    return f"redis+socket://{parts.path}?virtual_host={db}"


def settings_from_env() -> dict[str, Any]:
    """The app's configuration, from the environment (see the module docstring)."""
    return celery_settings(
        os.environ.get("QUEUESERVE_REDIS_URL") or DEFAULT_REDIS_URL,
        os.environ.get("QUEUESERVE_PREFIX") or "qs",
    )


def celery_settings(redis_url: str, prefix: str) -> dict[str, Any]:
    """Broker and backend on ``redis_url``, Celery's keys under ``<prefix>:celery:``."""
    url = celery_redis_url(redis_url)
    keyprefix = f"{prefix}:celery:"
    return {
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": {"global_keyprefix": keyprefix},
        "result_backend_transport_options": {"global_keyprefix": keyprefix},
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_track_started": True,
        "result_expires": 24 * 3600,
        # One long indexing job at a time per worker process; the batching is queueserve's.
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
    }


def make_app(settings: dict[str, Any] | None = None) -> Celery:
    """A Celery app with the indexing tasks, configured by ``settings`` (a test's Redis, say)
    or else by the environment, read when the app is first used."""
    app = Celery("tasks")
    app.add_defaults(settings if settings is not None else settings_from_env)
    app.task(bind=True, name=INDEX_TASK)(indexing.index_corpus)
    app.task(name=SEARCH_TASK)(indexing.search)
    # The jobs flow: submit returns the queueserve job ids at once; status and collect check
    # on them later, from any worker (docs/indexing.md, "Submit now, collect later").
    app.task(name=SUBMIT_TASK)(indexing.submit_index)
    app.task(name=STATUS_TASK)(indexing.index_status)
    app.task(name=COLLECT_TASK)(indexing.collect_index)
    return app


app = make_app()
# The module app's tasks: ``index_corpus.delay(limit=500)``, ``search.delay("query", k=5)``.
index_corpus = app.tasks[INDEX_TASK]
search = app.tasks[SEARCH_TASK]
