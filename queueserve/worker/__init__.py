"""The worker's side: supervisor, partitions, metrics, and the pipeline that serves batches.
Internal: use ``qs.Worker`` and the ``queueserve worker`` command."""
