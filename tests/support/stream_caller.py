"""A caller in a process of its own, for tests that kill callers: it streams one request and
prints each step's values as a JSON line the moment it arrives.

    python -m tests.support.stream_caller REDIS_URL PREFIX SERVING ITEM_JSON
"""

from __future__ import annotations

import json
import sys

import queueserve as qs


def main() -> None:
    url, prefix, serving, item = sys.argv[1:5]
    with qs.Client(url, prefix=prefix) as client:
        for event in client.stream(serving, [json.loads(item)], timeout=120):
            if isinstance(event, qs.Output):
                print(json.dumps(event.results), flush=True)


if __name__ == "__main__":
    main()
