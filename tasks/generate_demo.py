"""Stream generated text from the character-level GRU, served with continuous batching.

    python -m tasks.generate_demo ["prompt" ...] [--max-new 160] [--temperature 0.6]

Starts a private redis-server (or uses ``$QUEUESERVE_REDIS_URL``) and a worker serving
``tasks.charlm:charlm`` in this process, sends every prompt in one ``client.stream`` call
(each prompt is one sequence with a slot of its own, all generating together), prints the
first prompt's text live as its characters arrive, then every prompt's full text with its time
to first character and length.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import queueserve as qs

PROMPTS = [
    "Return a new ",
    "This module provides ",
    "Raise ValueError if ",
    "The socket ",
]


def _redis(stack: contextlib.ExitStack) -> str:
    url = os.environ.get("QUEUESERVE_REDIS_URL")
    if url:
        return url
    from queueserve.broker.embedded import EmbeddedRedis

    return stack.enter_context(EmbeddedRedis())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="*", default=PROMPTS)
    parser.add_argument("--max-new", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args(argv)
    from tasks.charlm import CharLM

    items = [
        {"prompt": p, "max_new": args.max_new, "temperature": args.temperature, "seed": i}
        for i, p in enumerate(args.prompts)
    ]
    texts = ["" for _ in items]
    first: list[float | None] = [None for _ in items]
    with contextlib.ExitStack() as stack:
        url = _redis(stack)
        prefix = f"demo{os.getpid()}"
        worker = qs.Worker([CharLM()], redis_url=url, prefix=prefix, handle_signals=False)
        worker.start()
        stack.callback(worker.stop, 30)
        client = stack.enter_context(contextlib.closing(qs.Client(url, prefix=prefix)))
        print(f"{len(items)} prompts generating together; the first one live:\n")
        sys.stdout.write(items[0]["prompt"])
        started = time.perf_counter()
        for event in client.stream("charlm", items, timeout=120):
            if not isinstance(event, qs.Output):
                continue
            for i, value in enumerate(event.results, event.start):
                if first[i] is None:
                    first[i] = time.perf_counter() - started
                texts[i] += value
                if i == 0:
                    sys.stdout.write(value)
                    sys.stdout.flush()
        took = time.perf_counter() - started
    print("\n")
    for item, text, ttft in zip(items, texts, first, strict=True):
        print(f"--- first character after {1000 * (ttft or 0):.0f} ms, {len(text)} characters")
        print(item["prompt"] + text + "\n")
    total = sum(len(t) for t in texts)
    print(f"{total} characters in {took:.2f}s ({total / took:.0f} characters/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
