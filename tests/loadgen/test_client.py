"""Client against local servers: timings, headers, bodies, and every fault as a recorded reason."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web

from loadgen.client import ClientConfig, build_body
from loadgen.record import RequestRecord
from loadgen.runner import execute, probe_prompt_format, probe_server
from loadgen.spec import ImageRef, RequestSpec
from loadgen.tokens import Segment, TokenSource

from .conftest import MockServer


def _spec(i: int = 0, n: int = 8, cls: str = "chat", at: float = 0.0) -> RequestSpec:
    segs = (Segment("sys", 16, shared=True), Segment(f"u{i}", 8))
    return RequestSpec(i, cls, at, n, segs)


def _run(url: str, specs: list[RequestSpec], **kw: Any) -> list[RequestRecord]:
    cfg = ClientConfig(
        base_url=url,
        model="mock",
        request_timeout_s=kw.pop("timeout", 10.0),
        prompt_format=kw.pop("prompt_format", "ids"),
    )
    out = asyncio.run(execute(specs, cfg, TokenSource(1), drain_timeout_s=10.0, **kw))
    return out.records


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ok_stream_timings_and_headers(mock_server: MockServer) -> None:
    specs = [_spec(i, n=10, at=0.01 * i) for i in range(5)]
    specs.append(
        RequestSpec(
            5,
            "vlm",
            0.0,
            6,
            images=(ImageRef(32, 24, "png", 0), ImageRef(32, 24, "jpeg", 1)),
            text="hi",
        )
    )
    recs = _run(mock_server.url, specs)
    assert [r.status for r in recs] == ["ok"] * 6, [r.error for r in recs]
    for r in recs[:5]:
        assert r.output_tokens == 10 and r.prompt_tokens == 24 and r.usage_present
        assert len(r.itl_s) == 9 and len(r.chunk_wall) == 10
        assert 0 < r.ttft_s <= r.e2e_s and r.tpot_s is not None and r.tpot_s > 0
        assert r.upload_bytes > 24 and r.endpoint == "/v1/completions"
        tt = r.server["token_times"]  # type: ignore[index]
        assert len(tt) == len(r.chunk_wall) and r.chunk_wall == sorted(r.chunk_wall)
        # causal: no chunk reaches the client before the server stamped its token (1 ms: the
        # client maps perf_counter onto the wall clock once per request)
        assert all(a >= b - 1e-3 for a, b in zip(r.chunk_wall, tt, strict=True))
    vlm = recs[5]
    assert vlm.endpoint == "/v1/chat/completions" and vlm.output_tokens == 6
    assert len(vlm.chunk_wall) == 6
    seen = mock_server.seen
    assert sorted(s["class"] for s in seen) == ["chat"] * 5 + ["vlm"]
    chat_body = next(s["body"] for s in seen if s["path"] == "/v1/completions")
    assert chat_body["stream"] and chat_body["ignore_eos"] and chat_body["max_tokens"] == 10
    assert chat_body["stream_options"] == {"include_usage": True}
    p0 = [s["body"]["prompt"] for s in seen if s["path"] == "/v1/completions"]
    assert all(p[:16] == p0[0][:16] for p in p0)  # shared system prefix
    parts = next(s["body"] for s in seen if s["class"] == "vlm")["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("http500", "http 500"),
        ("malformed", "malformed SSE"),
        ("cut", "stream cut"),
        ("error_event", "server error event"),
        ("no_done", "stream cut"),
    ],
)
def test_faults_are_recorded(mock_server: MockServer, fault: str, reason: str) -> None:
    mock_server.cfg.fault = fault
    recs = _run(mock_server.url, [_spec(i, n=6) for i in range(3)])
    for r in recs:
        assert r.status == "error" and r.error is not None and r.error.startswith(reason), r.error


def test_no_usage_falls_back_to_counted_chunks(mock_server: MockServer) -> None:
    mock_server.cfg.fault = "no_usage"
    (r,) = _run(mock_server.url, [_spec(n=7)])
    assert r.status == "ok" and not r.usage_present and r.output_tokens == 7


def test_unreachable_server() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    recs = _run(url, [_spec(i) for i in range(3)])
    assert all(r.status == "error" and r.error.startswith("connect error") for r in recs)
    info = asyncio.run(probe_server(url))
    assert not info.reachable and info.model is None
    assert info.error is not None and info.error.startswith("GET /v1/models: ClientConnectorError")


def test_probe_and_text_fallback(mock_server: MockServer) -> None:
    info = asyncio.run(probe_server(mock_server.url))
    assert info.model == "mock" and info.max_model_len == 4096
    cfg = ClientConfig(base_url=mock_server.url, model="mock")
    assert asyncio.run(probe_prompt_format(cfg)) == "ids"
    mock_server.cfg.fault = "reject_ids"
    assert asyncio.run(probe_prompt_format(cfg)) == "text"
    (r,) = _run(mock_server.url, [_spec()], prompt_format="text")
    assert r.status == "ok" and r.prompt_format == "text"
    assert isinstance(mock_server.seen[-1]["body"]["prompt"], str)


def test_stream_that_hangs_times_out(raw_server: Any) -> None:
    async def hang(req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b'data: {"choices":[{"text":"a"}]}\n\n')
        await asyncio.sleep(30)
        return resp

    url = raw_server(hang)
    (r,) = _run(url, [_spec()], timeout=0.5)
    assert r.status == "error" and r.error.startswith("timeout") and r.ttft_s is not None


def test_non_json_object_and_garbage_bytes(raw_server: Any) -> None:
    async def junk(req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b"data: [1,2]\n\n")
        return resp

    (r,) = _run(raw_server(junk), [_spec()])
    assert r.status == "error" and r.error.startswith("malformed SSE")


def test_max_concurrency_queues(mock_server: MockServer) -> None:
    mock_server.cfg.interval_ms = 10.0
    recs = _run(mock_server.url, [_spec(i, n=10) for i in range(6)], max_concurrency=2)
    assert all(r.status == "ok" for r in recs)
    # never more than two in flight, and two did run at once: a sweep over send..done
    edges = sorted(
        [(r.sent_s + r.e2e_s, -1) for r in recs] + [(r.sent_s, 1) for r in recs]
    )  # at a tie the end sorts first
    in_flight, peak = 0, 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 2


def test_drain_timeout_cancels_and_reports(raw_server: Any) -> None:
    async def slow(req: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response(text="late")

    cfg = ClientConfig(base_url=raw_server(slow), model="m", request_timeout_s=60)
    out = asyncio.run(execute([_spec()], cfg, TokenSource(1), drain_timeout_s=0.3))
    (r,) = out.records
    assert r.status == "error" and r.error.startswith("cancelled")  # not the 30 s answer


def _sse_server(raw_server: Any, events: list[bytes]) -> str:
    async def handler(req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for ev in events:
            await resp.write(ev)
            await asyncio.sleep(0.01)
        return resp

    return raw_server(handler)


def test_vllm_style_role_chunk_is_not_a_token(raw_server: Any) -> None:
    ev = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n']
    ev += [b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'] * 3
    ev += [
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}\n\n',
        b"data: [DONE]\n\n",
    ]
    spec = RequestSpec(0, "vlm", 0.0, 3, images=(ImageRef(8, 8, "png", 0),), text="x")
    (r,) = _run(_sse_server(raw_server, ev), [spec])
    assert r.status == "ok" and len(r.chunk_wall) == 3 and r.ttft_s > 0.007
    assert r.output_tokens == 3 and r.finish_reason == "length" and len(r.itl_s) == 2


def test_chunkscope_counts_every_choice_chunk(raw_server: Any) -> None:
    ev = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3},'
        b'"chunkscope":{"token_times":[1,2,3]}}\n\n',
        b"data: [DONE]\n\n",
    ]
    spec = RequestSpec(0, "vlm", 0.0, 3, images=(ImageRef(8, 8, "png", 0),), text="x")
    (r,) = _run(_sse_server(raw_server, ev), [spec])
    assert r.status == "ok" and len(r.chunk_wall) == 3 and r.server is not None


def test_completion_empty_text_chunks_count(raw_server: Any) -> None:
    ev = [
        b'data: {"choices":[{"index":0,"text":""}]}\n\n',
        b'data: {"choices":[{"index":0,"text":"ab"}]}\n\n',
        b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    (r,) = _run(_sse_server(raw_server, ev), [_spec(n=2)])
    assert r.status == "ok" and len(r.chunk_wall) == 2 and r.output_tokens == 2
    assert not r.usage_present and r.ttft_s is not None and r.e2e_s is not None
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (r.output_tokens - 1))


def test_the_class_goes_in_the_header_and_where_vllm_passes_it(mock_server: MockServer) -> None:
    (r,) = _run(mock_server.url, [_spec()])
    seen = mock_server.seen[-1]
    assert r.status == "ok" and seen["class"] == r.traffic_class
    assert "vllm_xargs" not in seen["body"]  # not for a server that is not vLLM
    tokens = TokenSource(1)
    cfg = ClientConfig(base_url="http://x", model="m", vllm_xargs=True)
    _, body = build_body(_spec(), cfg, tokens)
    assert body["vllm_xargs"] == {"traffic_class": _spec().traffic_class}


def test_chat_users_are_a_closed_loop(mock_server: MockServer) -> None:
    """Each user sends its next turn only once its answer has ended (never two of one user in
    flight), so the users keep about their count of streams in flight for the whole run."""
    from loadgen.profiles import ChatProfile
    from loadgen.workload import ChatUsers

    prof = ChatProfile(
        system_prompt_tokens=8, input_median=8, input_p90=16, input_max=32,
        output_median=20, output_p90=30, output_max=40, think_s=0.02,
    )  # fmt: skip
    users = ChatUsers(prof, 3, seed=1, max_model_len=4096, until_s=1.5, lead_s=0.3)
    recs = _run(mock_server.url, [_spec(0, n=5, cls="rag", at=0.2)], users=users)
    rag, turns = recs[0], recs[1:]
    assert rag.status == "ok" and rag.index == 0
    # the plan's request moved by the users' lead, after every user's first turn
    assert rag.scheduled_s == pytest.approx(0.5) and rag.sent_s is not None
    assert all(min(r.sent_s for r in turns if r.meta["user"] == u) < 0.05 for u in range(3))
    assert [r.status for r in turns] == ["ok"] * len(turns), [r.error for r in turns]
    assert sorted(r.index for r in turns) == list(range(1, len(turns) + 1))
    assert {r.meta["user"] for r in turns} == {0, 1, 2}
    assert all(r.traffic_class == "chat" and r.meta.get("background") for r in turns)
    for user in range(3):
        mine = sorted((r for r in turns if r.meta["user"] == user), key=lambda r: r.sent_s)
        assert len(mine) >= 5  # ~40 ms a turn over 1.5 s
        for prev, nxt in zip(mine, mine[1:], strict=False):
            assert nxt.sent_s >= prev.sent_s + prev.e2e_s  # the answer ended first
        assert mine[-1].sent_s < 1.5 + 0.3  # none sent after the end (plan time + lead)
    # the users' turns cover the run: a stream in flight at every instant after the stagger
    spans = sorted((r.sent_s, r.sent_s + r.e2e_s) for r in turns)
    for t in (0.6, 0.9, 1.2, 1.6):
        assert any(a <= t <= b + 0.1 for a, b in spans), t
