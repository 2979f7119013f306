"""Options, declared once: the units they are written in (``units``), the serving's and the
step serving's options (``serving``). The worker's are in ``queueserve.worker.options``.

Every way an option arrives goes through these models: ``qs.Serving(...)``, ``queueserve
config set``, the config and meta hashes read from Redis, the worker's flags and its
``QUEUESERVE_*`` environment variables. Nothing here does I/O.
"""
