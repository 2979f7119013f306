"""Operators' tools: the ``queueserve`` command line, stats, dead letters. Internal."""
