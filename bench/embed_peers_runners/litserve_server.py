"""LitServe serving all-MiniLM-L6-v2: one worker process on the CPU, requests batched up to
``--batch`` with a ``--wait`` timeout, each batch encoded by sentence-transformers.

LitServe batches requests, not texts: a batch of requests of several texts each is flattened,
encoded by ``encode(batch_size=--batch)`` (so the model never runs more than ``--batch``
texts at once) and split back. LitServe starts its inference worker with multiprocessing's
spawn, which imports this module again: the server starts under the ``__main__`` guard only.
"""

from __future__ import annotations

from typing import Any

import litserve as ls

from bench.embed_peers_runners._common import answer, load_model, parse_args, texts_of


class EmbedAPI(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, model_dir: str, batch: int, threads: int, **options: Any) -> None:
        super().__init__(**options)
        self.model_dir, self.batch_size, self.threads = model_dir, batch, threads

    def setup(self, device: str) -> None:
        self.model = load_model(self.model_dir, self.threads)

    # No annotation on ``request``: LitServe builds its route from it (a string one, as
    # postponed annotations make it, turns the body into a query parameter).
    def decode_request(self, request) -> tuple[str, list[str]]:  # type: ignore[no-untyped-def]
        return request.get("model", ""), texts_of(request)

    def predict(self, requests: list[tuple[str, list[str]]]) -> list[tuple[str, Any]]:
        flat = [t for _, texts in requests for t in texts]
        vectors = self.model.encode(flat, batch_size=self.batch_size).tolist()
        out, at = [], 0
        for name, texts in requests:
            out.append((name, vectors[at : at + len(texts)]))
            at += len(texts)
        return out

    def encode_response(self, output: tuple[str, Any]) -> dict[str, Any]:
        return answer(*output)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    api = EmbedAPI(
        args.model,
        args.batch,
        args.threads,
        max_batch_size=args.batch,
        batch_timeout=args.wait,
        api_path="/v1/embeddings",
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
