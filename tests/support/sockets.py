"""A fake socket transport for driving uvicorn's HTTP protocol in-process (the gateway's
protocol tests)."""

from __future__ import annotations

import asyncio
from typing import Any


class Socket(asyncio.Transport):
    """A transport that records what is sent on it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        assert not self.closed, "written after close"
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass
