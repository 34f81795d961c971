"""Run a plan: probe the server, send each request at its time (optionally capped in-flight),
drain, and return every request's record. Bounded: each request by its timeout, the tail by the
drain timeout; nothing is dropped silently (unsent or cancelled requests carry a reason)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadgen.client import ClientConfig, Prepared, prepare, send
from loadgen.images import data_url
from loadgen.progress import Progress
from loadgen.record import RequestRecord
from loadgen.saturation import load as offered_vs_served
from loadgen.spec import RequestSpec
from loadgen.tokens import TokenSource
from loadgen.workload import ChatUsers

logger = logging.getLogger(__name__)

SATURATION_CHECK_S = 15.0  # how often the run compares offered and served load


@dataclass
class ServerInfo:
    reachable: bool
    model: str | None = None
    max_model_len: int | None = None
    error: str | None = None
    models: list[str] = field(default_factory=list)
    owned_by: str | None = None  # /v1/models' owned_by: "vllm" for a vLLM server


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    wall_start: float
    wall_end: float
    duration_s: float
    warnings: list[str] = field(default_factory=list)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def probe_server(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0
) -> ServerInfo:
    """GET /v1/models: model name and context length (`max_model_len`, vLLM's field too)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.get(base_url + "/v1/models", headers=_headers(api_key)) as r,
        ):
            if r.status != 200:
                return ServerInfo(True, error=f"GET /v1/models: http {r.status}")
            body: Any = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return ServerInfo(False, error=f"GET /v1/models: {type(exc).__name__}: {exc}")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return ServerInfo(True, error="GET /v1/models: no models listed")
    mml = data[0].get("max_model_len")
    return ServerInfo(
        True,
        model=str(data[0].get("id")),
        models=[str(d.get("id")) for d in data if isinstance(d, dict)],
        max_model_len=int(mml) if isinstance(mml, int | float) else None,
        owned_by=str(data[0]["owned_by"]) if data[0].get("owned_by") is not None else None,
    )


async def probe_prompt_format(cfg: ClientConfig, token: int = 65) -> str:
    """'ids' if the server takes a token-id prompt on /v1/completions, 'text' if it answers 400.
    Detected once before the run; unreachable or other answers keep 'ids'."""
    body = {"model": cfg.model, "prompt": [token] * 4, "max_tokens": 1, "stream": False}
    timeout = aiohttp.ClientTimeout(total=min(cfg.request_timeout_s, 120.0))
    headers = {"X-Traffic-Class": "probe", **_headers(cfg.api_key)}
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.post(cfg.base_url + "/v1/completions", json=body, headers=headers) as r,
        ):
            await r.read()
            if r.status in (400, 422):
                logger.info("server refused a token-id prompt (http %d): sending text", r.status)
                return "text"
    except (aiohttp.ClientError, TimeoutError) as exc:
        logger.warning("prompt-format probe failed (%s); keeping token ids", exc)
    return "ids"


def prefetch_images(specs: list[RequestSpec]) -> int:
    """Encode every distinct image up front (cached), so the run never waits on Pillow."""
    refs = {img for s in specs for img in s.images}
    for ref in refs:
        data_url(*ref)
    return len(refs)


def new_record(spec: RequestSpec) -> RequestRecord:
    return RequestRecord(
        index=spec.index,
        traffic_class=spec.traffic_class,
        scheduled_s=spec.offset_s,
        max_tokens=spec.max_tokens,
        planned_prompt_tokens=spec.prompt_len,
        num_images=len(spec.images),
        meta=dict(spec.meta),
    )


async def execute(
    specs: list[RequestSpec],
    cfg: ClientConfig,
    tokens: TokenSource,
    *,
    max_concurrency: int | None = None,
    drain_timeout_s: float = 600.0,
    progress: Progress | None = None,
    users: ChatUsers | None = None,
) -> RunOutcome:
    """Send every request at `t0 + offset` (FIFO behind `max_concurrency` if set); beside them,
    ``users``' closed-loop chat turns, each sent when its user's previous answer has ended and
    its think time passed (their records follow the plan's, numbered on)."""
    lead = users.lead_s if users is not None and users.count else 0.0
    if lead:  # the users' first turns go out before the plan's first request
        for spec in specs:
            spec.offset_s += lead
    records = [new_record(s) for s in specs]
    users_until = None if users is None or users.until_s is None else users.until_s + lead
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(
        limit=max_concurrency or 0, limit_per_host=0, ttl_dns_cache=300
    )
    tasks: set[asyncio.Task[None]] = set()
    counts = {"sent": 0, "done": 0, "errors": 0}
    sent_at: list[float] = []
    done_at: list[float] = []
    warnings: list[str] = []

    async def one(spec: RequestSpec, prep: Prepared, rec: RequestRecord) -> None:
        try:
            await send(session, spec, prep, rec, cfg, t0)
        finally:
            if sem is not None:
                sem.release()
            counts["done"] += 1
            counts["errors"] += rec.status == "error"
            done_at.append(time.perf_counter() - t0)

    async def ticker() -> None:
        last_check = 0.0
        for _ in range(10_000_000):  # bounded; cancelled when the run ends
            if progress is not None:
                progress.update(counts["sent"], counts["done"], counts["errors"])
            now = time.perf_counter() - t0
            if now - last_check >= SATURATION_CHECK_S:
                last_check = now
                lo = offered_vs_served(sent_at, done_at, now)
                if lo is not None and lo.overloaded:
                    text = f"at {now:.0f} s: {lo.describe()}"
                    warnings.append(text)
                    logger.warning("%s", text)
            await asyncio.sleep(0.25)

    # Objects alive now (plan, images, modules) are never garbage: moving them out of the
    # collector's reach removes the ~20 ms full-collection pauses that would delay chunk stamps.
    gc.collect()
    gc.freeze()
    wall_start = time.time()
    t0 = time.perf_counter()
    tick = asyncio.create_task(ticker())
    plan_sent = asyncio.Event()

    def prepared(spec: RequestSpec, rec: RequestRecord) -> Prepared | None:
        """The request's body, or None once its record says why it could not be built."""
        try:
            return prepare(spec, cfg, tokens)
        except Exception as exc:  # noqa: BLE001 - record and go on
            rec.fail(f"client error: could not build request: {type(exc).__name__}: {exc}")
            counts["done"] += 1
            counts["errors"] += 1
            return None

    async def user_loop(user: int) -> None:
        assert users is not None
        for pause, spec in users.turns(user):
            if pause > 0:
                await asyncio.sleep(pause)
            now = time.perf_counter() - t0
            if (users_until is not None and now >= users_until) or (
                users_until is None and plan_sent.is_set()
            ):
                return
            spec.offset_s = now
            spec.index = len(specs) + len(user_records)
            rec = new_record(spec)
            user_records.append(rec)
            prep = prepared(spec, rec)
            if prep is None:
                continue
            counts["sent"] += 1
            sent_at.append(now)
            try:
                await send(session, spec, prep, rec, cfg, t0)
            finally:
                counts["done"] += 1
                counts["errors"] += rec.status == "error"
                done_at.append(time.perf_counter() - t0)

    user_tasks: list[asyncio.Task[None]] = []
    user_records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            for user in range(users.count if users is not None else 0):
                user_tasks.append(asyncio.create_task(user_loop(user)))
            for spec, rec in zip(specs, records, strict=True):
                prep = prepared(spec, rec)
                if prep is None:
                    continue
                delay = t0 + spec.offset_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is not None:
                    await sem.acquire()
                counts["sent"] += 1
                sent_at.append(time.perf_counter() - t0)
                task = asyncio.create_task(one(spec, prep, rec))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if users_until is not None:
                # the users go on until their end even when the plan's last send came earlier
                await asyncio.sleep(max(0.0, t0 + users_until - time.perf_counter()))
            plan_sent.set()
            waiting = set(tasks) | {t for t in user_tasks if not t.done()}
            if waiting:
                _, pending = await asyncio.wait(waiting, timeout=drain_timeout_s)
                for task in pending:
                    task.cancel()
                for rec in [*records, *user_records]:
                    if rec.status == "pending" and rec.sent_s is not None:
                        rec.fail(f"cancelled: not finished within the {drain_timeout_s:g} s drain")
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for task in [*tasks, *user_tasks]:
                task.cancel()
            if tasks or user_tasks:
                await asyncio.gather(*tasks, *user_tasks, return_exceptions=True)
            for rec in [*records, *user_records]:
                if rec.status == "pending":
                    rec.fail(
                        "not sent: run interrupted"
                        if rec.sent_s is None
                        else "cancelled: run interrupted"
                    )
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
            if progress is not None:
                progress.update(counts["sent"], counts["done"], counts["errors"], final=True)
            gc.unfreeze()
    return RunOutcome(
        [*records, *user_records], wall_start, time.time(), time.perf_counter() - t0, warnings
    )
