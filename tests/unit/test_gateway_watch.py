"""The gateway's disconnect watches (gateway/watch.py): a call that ends lets go of its
request at once, though its watch stays queued until the next sweep."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from queueserve.gateway.watch import WATCH_AFTER_S, Watches


class Ticket:
    cancelled = False

    async def cancel(self) -> bool:
        self.cancelled = True
        return True


async def test_an_ended_call_is_let_go_before_the_sweep() -> None:
    watches = Watches()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    ticket = Ticket()
    held = weakref.ref(ticket)
    watches.watch(receive, ticket).end()  # type: ignore[arg-type]
    del ticket
    assert held() is None  # the ended watch is still queued: it holds nothing of the call
    watches.close()


async def test_a_call_whose_client_left_is_cancelled_after_the_sweep() -> None:
    watches = Watches()
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    ticket = Ticket()
    watch = watches.watch(receive, ticket)  # type: ignore[arg-type]
    gone.set()
    while not ticket.cancelled:  # the sweep starts its watcher WATCH_AFTER_S in
        await asyncio.sleep(WATCH_AFTER_S / 5)
    watch.end()
    watches.close()
