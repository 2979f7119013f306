"""Ray Serve serving all-MiniLM-L6-v2: one replica holding the model, ``@serve.batch`` with
``max_batch_size=--batch`` and ``batch_wait_timeout_s=--wait``, behind Ray Serve's HTTP proxy.

Each text of a request is one call of the batched method, so texts from all requests share
batches. ``max_ongoing_requests`` is raised from Ray Serve's default of 5, which would let at
most 5 requests (so batches of at most 5 one-text requests) into the replica at once. Runs until
SIGTERM, then shuts Serve and Ray down.

No ``from __future__ import annotations`` here: FastAPI reads the route's ``request: Request``
annotation, and a postponed (string) one makes it a query parameter.
"""

import asyncio
import signal
import threading
from typing import Any

from fastapi import FastAPI, Request
from ray import serve

from bench.embed_peers_runners._common import answer, load_model, parse_args, texts_of

MAX_ONGOING = 1024  # requests let into the replica at once: never the cap of a batch

app = FastAPI()


@serve.deployment(
    num_replicas=1, max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 1}
)
@serve.ingress(app)
class Embedder:
    def __init__(self, model_dir: str, batch: int, wait: float, threads: int) -> None:
        self.model = load_model(model_dir, threads)
        self.embed.set_max_batch_size(batch)
        self.embed.set_batch_wait_timeout_s(wait)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.010)
    async def embed(self, texts: list[str]) -> list[list[float]]:
        vectors: list[list[float]] = self.model.encode(texts, batch_size=len(texts)).tolist()
        return vectors

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        vectors = await asyncio.gather(*(self.embed(t) for t in texts_of(body)))
        return answer(body.get("model", ""), list(vectors))


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(
        Embedder.bind(args.model, args.batch, args.wait, args.threads),
        name="embed",
        route_prefix="/",
    )
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):  # a Python wait, so SIGTERM's handler runs
        pass
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
