"""``queueserve dashboard``: a web page of servings, workers, queues, throughput and dead
letters, with replay, drop and ``config set`` (the ``dashboard`` extra; docs/operations.md)."""

from queueserve.dashboard.app import create_app

__all__ = ["create_app"]
