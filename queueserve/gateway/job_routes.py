"""Jobs over HTTP (docs/http.md, "Jobs"): ``POST /v1/servings/{name}/jobs`` submits one, and
``/v1/jobs/{id}`` follows it from any gateway with the same Redis and prefix: ``GET`` its
status and progress, ``GET .../result`` (waiting up to ``?timeout=``), ``POST .../cancel``,
``DELETE`` to forget it. The client's jobs API does the work (AsyncClient.job); the id handed
out is the tenant's own (job_ids.py): another tenant's requests for it answer 404."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queueserve.client.async_client import AsyncTicket
from queueserve.client.job_handles import AsyncJob
from queueserve.door.body import JSON, NoBool, idempotency_key
from queueserve.door.http_errors import ApiError, bad_request, from_queueserve, item_error
from queueserve.errors import Cancelled, QueueServeError, Timeout
from queueserve.gateway.core import Gateway
from queueserve.gateway.servings import Options, encoded, serving_body
from queueserve.gateway.sse import disconnected
from queueserve.gateway.tenants import caller
from queueserve.wire.job_record import MAX_KEEP_MS

DEFAULT_KEEP_S = 3600.0  # an answer no one fetched within the hour is rarely wanted
MAX_WAIT_S = 300.0  # what one ``GET .../result`` may wait: proxies cut longer idle requests


class SubmitJob(Options):
    items: Annotated[list[Any], Field(min_length=1)]
    keep: Annotated[float, Field(gt=0, le=MAX_KEEP_MS / 1000, allow_inf_nan=False), NoBool] = (
        DEFAULT_KEEP_S
    )


def routes(gw: Gateway) -> list[Route]:
    async def submit(request: Request) -> Response:
        name, body = await serving_body(gw, request, SubmitJob)
        tenant = caller(request.scope)
        key = idempotency_key(request.scope)
        ticket = await gw.submit(tenant, name, body.items, body, body.keep, key)
        job = await placed(gw, ticket)
        gw.quotas.job_placed(ticket, job.id)
        shown = await gw.job_ids.http_id(tenant, job.id)
        return JSON(
            {"id": shown, "status": "queued", "total": len(body.items)},
            status_code=202,
            headers={"Location": f"{request.scope.get('root_path', '')}/v1/jobs/{shown}"},
        )

    async def show(request: Request) -> Response:
        return JSON(await state(await job_of(gw, request)))

    async def result(request: Request) -> Response:
        wait, return_exceptions = result_query(request)
        job = await job_of(gw, request)
        try:
            results = await until_disconnected(
                request, job.job.result(wait, return_exceptions=True)
            )
        except Timeout:  # not ended within the wait: where it stands, and to come back
            return JSON(await state(job), status_code=202, headers={"Retry-After": "1"})
        except QueueServeError as e:
            raise await job_error(job, e) from None
        return answer(job.shown, results, return_exceptions)

    async def cancel(request: Request) -> Response:
        job = await job_of(gw, request)
        cancelled = await cancel_job(gw, job)
        return JSON({"id": job.shown, "cancelled": cancelled, **await state(job)})

    async def forget(request: Request) -> Response:
        job = await job_of(gw, request)
        if not await job.job.forget():
            raise unknown(job.shown)
        return JSON({"id": job.shown, "forgotten": True})

    return [
        Route("/v1/servings/{name}/jobs", submit, methods=["POST"]),
        Route("/v1/jobs/{id}", show, methods=["GET"]),
        Route("/v1/jobs/{id}", forget, methods=["DELETE"]),
        Route("/v1/jobs/{id}/result", result, methods=["GET"]),
        Route("/v1/jobs/{id}/cancel", cancel, methods=["POST"]),
    ]


async def cancel_job(gw: Gateway, job: HttpJob) -> bool:
    """Cancel ``job``; True when this call ended it (its items no longer count against its
    tenant's max_queued)."""
    try:
        cancelled = await job.job.cancel()
    except QueueServeError as e:
        raise await job_error(job, e) from None
    if cancelled:
        gw.quotas.job_cancelled(job.job.id)
    return cancelled


def answer(job_id: str, results: list[Any], return_exceptions: bool) -> Response:
    """An ended job's results; without ``return_exceptions`` its first item error instead,
    with the status a dispatch gets."""
    failed = [r for r in results if isinstance(r, QueueServeError)]
    if failed and not return_exceptions:
        raise from_queueserve(failed[0])
    return encoded(
        {
            "id": job_id,
            "status": "failed" if failed else "done",
            "results": [item_error(r) if isinstance(r, QueueServeError) else r for r in results],
        }
    )


@dataclass(frozen=True, slots=True)
class HttpJob:
    """A job as its tenant sees it over HTTP: the client's job, and the id it was handed."""

    job: AsyncJob
    shown: str


async def job_of(gw: Gateway, request: Request) -> HttpJob:
    """The job the path names for the caller's tenant; 404 for any id that is not one of its
    own (another tenant's, a guess, a malformed one), the same answer as for a forgotten job."""
    shown = request.path_params["id"]
    job_id = await gw.job_ids.job_id(caller(request.scope), shown)
    if job_id is None:
        raise unknown(shown)
    try:
        return HttpJob(gw.client.job(job_id), shown)
    except ValueError:  # a tag that checks out names a job id the gateway made: never here
        raise unknown(shown) from None


async def placed(gw: Gateway, ticket: AsyncTicket) -> AsyncJob:
    """The job of ``ticket`` once its record is in Redis (``await ticket.id``), so the id
    answered holds whatever becomes of this process. A send Redis refused (a full queue)
    raises its error: Redis is asked only when the ticket had ended by then (refused, or
    answered already), and one still under way after the client's reconnect window is 503."""
    try:
        job = gw.client.job(await ticket.id)
        if ticket.done() and await job.status() == "expired":
            await ticket.result()  # its send failed: that error (else it ran, and is forgotten)
    except QueueServeError as e:
        raise from_queueserve(e) from None
    return job


async def state(job: HttpJob) -> dict[str, Any]:
    """A job's ``{id, status, done, total}``; 404 when it has no record."""
    try:
        status = await job.job.status()
        if status == "expired":
            raise unknown(job.shown)
        progress = await job.job.progress()
    except QueueServeError as e:
        raise await job_error(job, e) from None
    return {"id": job.shown, "status": status, "done": progress.done, "total": progress.total}


async def job_error(job: HttpJob, error: QueueServeError) -> ApiError:
    """The HTTP form of what a job's read raised: its own error mapped as any call's; a
    cancelled job 409 (it ended so, asking again will not change it); no record 404;
    a record that is not queueserve's 502."""
    if isinstance(error, Cancelled):
        return ApiError(409, "cancelled", str(error))
    if type(error) is not QueueServeError:
        return from_queueserve(error)
    if await job.job.status() == "expired":
        return unknown(job.shown)
    return ApiError(502, "job_failed", str(error))


def unknown(shown: str) -> ApiError:
    return ApiError(
        404,
        "unknown_job",
        f"job {shown[:200]!r} has no record under this prefix for this caller: its keep "
        "passed, it was forgotten, it never existed, or another tenant made it",
    )


def result_query(request: Request) -> tuple[float, bool]:
    """``?timeout=`` (seconds to wait, 0 to MAX_WAIT_S, default 0) and
    ``?return_exceptions=`` (true or false), or 400 saying what is wrong."""
    query = request.query_params
    extra = set(query) - {"timeout", "return_exceptions"}
    if extra:
        raise bad_request(f"unknown query parameters {sorted(extra)!r:.200}")
    text = query.get("timeout", "0")
    try:
        wait = float(text)
    except ValueError:
        wait = math.nan
    if not 0 <= wait <= MAX_WAIT_S:
        raise bad_request(f"timeout must be seconds from 0 to {MAX_WAIT_S:g}, got {text!r:.50}")
    flag = query.get("return_exceptions", "false")
    if flag not in ("true", "false"):
        raise bad_request(f"return_exceptions must be true or false, got {flag!r:.50}")
    return wait, flag == "true"


async def until_disconnected(request: Request, waiting: Any) -> Any:
    """``waiting``'s result, or nothing more done if the HTTP client leaves first (the job
    goes on: only the wait ends)."""
    loop = asyncio.get_running_loop()
    work, gone = loop.create_task(waiting), loop.create_task(disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        work.cancel()
    if work.cancelled():  # no one reads this answer; the metrics count it
        raise ApiError(499, "client_closed_request", "the HTTP client left before the answer")
    return work.result()
