"""The caller's side: request planning and ordering (no I/O), the sync and asyncio
clients. Internal: use ``qs.Client`` / ``qs.AsyncClient``."""
