"""Index a corpus through queueserve, and search it: the bodies of the Celery tasks.

``tasks.celery_app`` registers :func:`index_corpus` (bound: it reports progress as task state)
and :func:`search` as the tasks ``tasks.index_corpus`` and ``tasks.search``; and the jobs
flow, :func:`submit_index` (returns at once with the queueserve job ids), :func:`index_status`
and :func:`collect_index`, any of which may run in another process than the others. The
embedding itself runs in queueserve workers (``queueserve worker tasks.embed:embed``): the
tasks only chunk documents, send them through queueserve and store what comes back.

The index is one ``index.npz`` in a directory (``index_dir=``, else ``$EMBED_INDEX_DIR``, else
``./.index``): float32 unit vectors (n, 384), and the ids and texts as UTF-8 bytes with offsets,
so loading it never unpickles. It is written to a temporary file and renamed over the old one, so
a search never sees half an index. docs/indexing.md says why files and not Redis.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import queueserve as qs

from .corpus import stdlib_passages
from .embed import DIM, embed, length_bucket

INDEX_FILE = "index.npz"
PROGRESS_EVERY_S = 0.25  # at most four PROGRESS writes a second to the result backend
JOB_KEEP_S = 24 * 3600  # how long submit_index's answers wait in Redis for collect_index


def resolve_index_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where the index lives: ``path``, else ``$EMBED_INDEX_DIR``, else ``./.index``."""
    return Path(path or os.environ.get("EMBED_INDEX_DIR") or ".index")


def _pack(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    blobs = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets


def _unpack(data: np.ndarray, offsets: np.ndarray) -> list[str]:
    raw = data.tobytes()
    return [raw[a:b].decode("utf-8") for a, b in itertools.pairwise(offsets.tolist())]


@dataclass(frozen=True)
class Index:
    """Unit vectors with their passage ids and texts, row i for passage i."""

    ids: list[str]
    texts: list[str]
    vectors: np.ndarray

    def save(self, directory: Path) -> Path:
        """Write ``directory/index.npz`` atomically (temporary file, then rename)."""
        directory.mkdir(parents=True, exist_ok=True)
        ids, id_offsets = _pack(self.ids)
        texts, text_offsets = _pack(self.texts)
        fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".npz", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    vectors=self.vectors,
                    ids=ids,
                    id_offsets=id_offsets,
                    texts=texts,
                    text_offsets=text_offsets,
                )
            target = directory / INDEX_FILE
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    @classmethod
    def load(cls, directory: Path) -> Index:
        path = directory / INDEX_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no index at {path}: run the tasks.index_corpus task first (or pass the "
                "index_dir it wrote to)"
            )
        with np.load(path, allow_pickle=False) as z:
            return cls(
                _unpack(z["ids"], z["id_offsets"]),
                _unpack(z["texts"], z["text_offsets"]),
                z["vectors"],
            )

    def top(self, vector: np.ndarray, k: int) -> list[tuple[str, float, str]]:
        """The k passages most similar to ``vector`` (cosine: all vectors are unit length),
        best first, as (id, score, text); ties keep index order."""
        scores = self.vectors @ np.asarray(vector, dtype=np.float32)
        order = np.argsort(-scores, kind="stable")[:k]
        return [(self.ids[i], float(scores[i]), self.texts[i]) for i in order]


@functools.cache
def client() -> qs.Client:
    """One queueserve client per process (thread-safe; made on first use, so after a fork),
    on ``$QUEUESERVE_REDIS_URL`` under ``$QUEUESERVE_PREFIX``."""
    return qs.Client()


class Progress:
    """``on_progress`` for ``client.map``: writes Celery PROGRESS states, throttled."""

    def __init__(self, task: Any, total: int) -> None:
        self.task = task
        self.total = total
        self.started = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, total: int | None = None) -> None:
        now = time.perf_counter()
        if done < self.total and now - self._last < PROGRESS_EVERY_S:
            return
        self._last = now
        elapsed = max(now - self.started, 1e-9)
        self.task.update_state(
            state="PROGRESS",
            meta={
                "done": done,
                "total": self.total,
                "items_per_s": round(done / elapsed, 2),
            },
        )


def passage_key(passage_id: str, text: str) -> str:
    """The idempotency key of one passage's embedding: its id and a digest of its text (an id
    too long for a key, a digest of it)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    key = f"passage:{passage_id}:{digest}"
    if len(key.encode()) > 200 or not key.isprintable():  # wire/once.py MAX_KEY_BYTES
        key = f"passage:{hashlib.blake2b(passage_id.encode(), digest_size=16).hexdigest()}:{digest}"
    return key


def index_corpus(
    task: Any,
    limit: int | None = None,
    index_dir: str | None = None,
    chunk_size: int = 128,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Embed the standard library's docstring passages (the first ``limit`` of them, taken
    across all modules) through queueserve and store the index; returns a summary."""
    passages = stdlib_passages(limit)
    texts = [p.text for p in passages]
    progress = Progress(task, len(texts))
    progress(0)
    vectors = np.empty((len(texts), DIM), dtype=np.float32)
    # A key per passage (its id and a digest of its text): a retried task (a timeout, a
    # worker lost) gets the passages embedded before from Redis instead of embedding them
    # again, for a day (the serving's idempotency_ttl); a passage whose text changed is new.
    keys = {p.text: passage_key(p.id, p.text) for p in passages}
    results = client().map(
        embed,
        texts,
        chunk_size=chunk_size,
        timeout=timeout,
        on_progress=progress,
        idempotency_key=keys.__getitem__,
    )
    for i, vector in enumerate(results):
        vectors[i] = vector
    seconds = time.perf_counter() - progress.started
    directory = resolve_index_dir(index_dir)
    path = Index([p.id for p in passages], texts, vectors).save(directory)
    search_cache.cache_clear()
    return {
        "count": len(texts),
        "seconds": round(seconds, 3),
        "items_per_s": round(len(texts) / seconds, 2) if seconds > 0 else None,
        "index": str(path),
        "buckets": dict(sorted(Counter(length_bucket(t) for t in texts).items())),
    }


def submit_index(
    limit: int | None = None, chunk_size: int = 128, keep: float = JOB_KEEP_S
) -> dict[str, Any]:
    """Send the corpus as queueserve jobs (``submit(..., keep=)``) and return at once: one job
    per chunk of one length bucket, each with the passages it holds. What it returns is all
    ``index_status`` and ``collect_index`` need, from any process: the process that submitted
    may restart, the answers wait in Redis for ``keep`` seconds after they are done."""
    texts = [p.text for p in stdlib_passages(limit)]
    buckets: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        buckets.setdefault(length_bucket(text), []).append(i)
    jobs = []
    for bucket, positions in buckets.items():
        for lo in range(0, len(positions), chunk_size):
            part = positions[lo : lo + chunk_size]
            chunk = [texts[i] for i in part]
            ticket = client().submit(embed, chunk, batch_key=bucket, keep=keep)
            jobs.append([ticket.id, part])
    return {"limit": limit, "count": len(texts), "jobs": jobs}


def index_status(submitted: dict[str, Any]) -> dict[str, Any]:
    """How far the jobs of ``submit_index`` are: "running" until all are done ("failed" as
    soon as one failed, was cancelled or expired), items embedded of the total, jobs by
    status."""
    done, statuses = 0, Counter[str]()
    for job_id, positions in submitted["jobs"]:
        job = client().job(job_id)
        status = job.status()
        statuses[status] += 1
        if status == "done":
            done += len(positions)
        elif status in ("queued", "running"):
            done += job.progress().done
    ended_badly = any(s in statuses for s in ("failed", "cancelled", "expired"))
    whole = statuses["done"] == len(submitted["jobs"])
    state = "failed" if ended_badly else "done" if whole else "running"
    return {"status": state, "done": done, "total": submitted["count"], "jobs": dict(statuses)}


def collect_index(
    submitted: dict[str, Any], index_dir: str | None = None, timeout: float = 600.0
) -> dict[str, Any]:
    """Wait for the jobs of ``submit_index`` (up to ``timeout`` seconds each) and store the
    index, as ``index_corpus`` does; returns its summary."""
    started = time.perf_counter()
    passages = stdlib_passages(submitted["limit"])
    texts = [p.text for p in passages]
    vectors = np.empty((len(texts), DIM), dtype=np.float32)
    for job_id, positions in submitted["jobs"]:
        for i, vector in zip(positions, client().job(job_id).result(timeout=timeout), strict=True):
            vectors[i] = vector
    path = Index([p.id for p in passages], texts, vectors).save(resolve_index_dir(index_dir))
    search_cache.cache_clear()
    return {
        "count": len(texts),
        "seconds": round(time.perf_counter() - started, 3),
        "index": str(path),
        "jobs": len(submitted["jobs"]),
    }


@functools.lru_cache(maxsize=4)
def search_cache(directory: Path, mtime_ns: int, size: int) -> Index:
    """Indexes stay loaded between searches until the file changes (its stat is the key)."""
    return Index.load(directory)


def load_index(directory: Path) -> Index:
    try:
        st = (directory / INDEX_FILE).stat()
    except FileNotFoundError:
        return Index.load(directory)  # raises the explanatory error
    return search_cache(directory.resolve(), st.st_mtime_ns, st.st_size)


def search(
    query: str,
    k: int = 5,
    index_dir: str | None = None,
    timeout: float = 60.0,
) -> list[tuple[str, float, str]]:
    """The top ``k`` passages for ``query`` as (id, score, text), best first; the query is
    embedded by the same queueserve serving as the passages were."""
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"search needs a non-empty query string, got {query!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    index = load_index(resolve_index_dir(index_dir))
    vector = client().dispatch(embed, query, timeout=timeout)
    return index.top(vector, k)
