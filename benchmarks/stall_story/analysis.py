"""The stall story's figures from the raw runs: latency rows per window (client and engine
side), served steps against the in-process cost model, the per-step CPU trace."""

from __future__ import annotations

from typing import Any

import numpy as np


def pct(values: Any, q: float) -> float | None:
    a = np.asarray(values, dtype=np.float64)
    a = a[~np.isnan(a)]
    return float(np.percentile(a, q)) if a.size else None


def latency_row(
    itl_ms: Any, tpot_ms: Any, rag_ttft_ms: Any, chat_ttft_ms: Any, tokens: int, seconds: float
) -> dict[str, Any]:
    itl = np.asarray(itl_ms, dtype=np.float64)
    return {
        "chat_itl_n": int(itl.size),
        "chat_itl_p50_ms": pct(itl, 50),
        "chat_itl_p99_ms": pct(itl, 99),
        "chat_itl_p999_ms": pct(itl, 99.9),
        "chat_itl_max_ms": float(itl.max()) if itl.size else None,
        "chat_tpot_p50_ms": pct(tpot_ms, 50),
        "chat_tpot_p99_ms": pct(tpot_ms, 99),
        "rag_ttft_n": int(np.asarray(rag_ttft_ms).size),
        "rag_ttft_p50_ms": pct(rag_ttft_ms, 50),
        "rag_ttft_p99_ms": pct(rag_ttft_ms, 99),
        "chat_ttft_p50_ms": pct(chat_ttft_ms, 50),
        "chat_ttft_p99_ms": pct(chat_ttft_ms, 99),
        "output_tokens": int(tokens),
        "output_tokens_per_s": tokens / seconds if seconds > 0 else None,
    }


def client_windows(
    served: dict[str, Any], bounds: list[tuple[str, float, float]]
) -> list[dict[str, Any]]:
    """Per window, from SSE arrival times: a gap belongs to the window its first token is in, a
    request's TPOT and TTFT to the window it was sent in, a token to the window it arrived in."""
    reqs = [r for r in served["requests"] if r.error is None and r.chunk_times]
    rows = []
    for label, lo, hi in bounds:
        itl, tpot, rag_ttft, chat_ttft, tokens, delivery = [], [], [], [], 0, []
        for r in reqs:
            t = np.asarray(r.chunk_times)
            tokens += int(((t >= lo) & (t < hi)).sum())
            if len(r.engine_token_times) == t.size:
                lag = (t - np.asarray(r.engine_token_times)) * 1e3
                delivery.extend(lag[(t >= lo) & (t < hi)].tolist())
            if r.traffic_class == "chat":
                gaps = np.diff(t) * 1e3
                # a gap belongs to the window its first token is in: the step that ends it
                # started then, under that window's budget (engine times where known)
                known = len(r.engine_token_times) == t.size
                earlier = np.asarray(r.engine_token_times)[:-1] if known else t[:-1]
                itl.extend(gaps[(earlier >= lo) & (earlier < hi)].tolist())
            if lo <= r.sent < hi:
                ttft = (t[0] - r.sent) * 1e3
                if r.traffic_class == "rag":
                    rag_ttft.append(ttft)
                else:
                    chat_ttft.append(ttft)
                    if t.size >= 2:
                        tpot.append((t[-1] - t[0]) / (t.size - 1) * 1e3)
        row = {"window": label, **latency_row(itl, tpot, rag_ttft, chat_ttft, tokens, hi - lo)}
        row["delivery_p50_ms"] = pct(delivery, 50)
        row["delivery_p99_ms"] = pct(delivery, 99)
        row["delivery_max_ms"] = float(np.max(delivery)) if delivery else None
        rows.append(row)
    return rows


def engine_windows(
    store: dict[str, Any], bounds: list[tuple[str, float, float]]
) -> list[dict[str, Any]]:
    """Per window, from the stored events (engine clock): same definitions as the client's."""
    itl = store["itl"]
    reqs = store["requests"]
    chunks = store["chunks"]
    steps = store["steps"]
    produced = (
        chunks[chunks["produced_token"]].groupby("step").size() if chunks is not None else None
    )
    step_end = steps.set_index("step")["end"]
    rows = []
    for label, lo, hi in bounds:
        earlier = itl["time"] - itl["itl_ms"] / 1e3  # as the client side: by the gap's start
        chat_itl = itl[(itl["traffic_class"] == "chat") & (earlier >= lo) & (earlier < hi)]
        sent = reqs[(reqs["arrival"] >= lo) & (reqs["arrival"] < hi)]
        chat = sent[sent["traffic_class"] == "chat"]
        rag = sent[sent["traffic_class"] == "rag"]
        tokens = 0
        if produced is not None:
            ends = step_end.reindex(produced.index)
            tokens = int(produced[(ends >= lo) & (ends < hi)].sum())
        rows.append(
            {
                "window": label,
                **latency_row(
                    chat_itl["itl_ms"],
                    chat["tpot_ms"].dropna(),
                    rag["ttft_ms"].dropna(),
                    chat["ttft_ms"].dropna(),
                    tokens,
                    hi - lo,
                ),
            }
        )
    return rows


def works_from_events(events: list[Any]) -> list[Any]:
    from engine.core.cost_model import StepWork

    return [StepWork.from_chunks(e.chunks) for e in events]


def works_from_store(chunks: Any) -> dict[int, Any]:
    from engine.core.cost_model import StepWork

    out = {}
    for step, group in chunks.groupby("step"):
        out[int(step)] = StepWork.from_chunks(
            group[["kind", "start", "num_tokens"]].to_dict("records")
        )
    return out


def step_kind(work: Any) -> str:
    return "decode" if work.prefill_tokens == 0 else "prefill"


def cost_comparison(
    inproc: dict[str, Any],
    store: dict[str, Any],
    served_bounds: dict[str, tuple[int, int]],
    inproc_wait: dict[int, float] | None = None,
    served_wait: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Fit the cost model per (window, step kind) on in-process steps; divide each served step's
    duration by its prediction. With ``*_wait`` (step -> seconds its threads waited for a CPU,
    from the step traces) that wait is taken off every duration first: what is left is the
    step's time on a CPU, which other processes on the machine cannot stretch."""
    from engine.core.cost_model import fit

    iw = inproc_wait or {}
    sw = served_wait or {}

    events = inproc["steps"]
    works = works_from_events(events)
    labels = inproc["labels"]
    bnd = inproc["boundaries"] + [10**12]
    models: dict[tuple[str, str], Any] = {}
    ranges: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    inproc_ratios: dict[tuple[str, str], list[float]] = {}
    for i, label in enumerate(labels):
        lo, hi = bnd[i], bnd[i + 1]
        for kind in ("decode", "prefill"):
            sel = [
                (w, max(1e-6, e.duration - iw.get(e.step, 0.0)))
                for w, e in zip(works, events, strict=True)
                if lo <= e.step < hi and step_kind(w) == kind
            ]
            if len(sel) < 8:
                continue
            model = fit([w for w, _ in sel], [t for _, t in sel])
            models[(label, kind)] = model
            rows = np.array([w.row()[1:] for w, _ in sel])
            ranges[(label, kind)] = (rows.min(axis=0), rows.max(axis=0))
            pred = model.predict_many([w for w, _ in sel])
            inproc_ratios[(label, kind)] = (np.array([t for _, t in sel]) / pred).tolist()
    served_works = works_from_store(store["chunks"])
    steps = store["steps"].set_index("step")
    served_ratios: dict[tuple[str, str], list[float]] = {}
    served_durations: dict[tuple[str, str], list[float]] = {}
    outside: dict[tuple[str, str], int] = {}
    for label, (lo, hi) in served_bounds.items():
        for step, row in steps.loc[(steps.index >= lo) & (steps.index < hi)].iterrows():
            w = served_works.get(int(step))
            if w is None:
                continue
            key = (label, step_kind(w))
            model = models.get(key)
            if model is None:
                continue
            lo_w, hi_w = ranges[key]
            x = np.array(w.row()[1:])
            if np.any(x < lo_w) or np.any(x > hi_w):  # no in-process step like it: no prediction
                outside[key] = outside.get(key, 0) + 1
                continue
            dur = max(1e-6, row["duration_ms"] / 1e3 - sw.get(int(step), 0.0))
            served_ratios.setdefault(key, []).append(dur / max(model.predict(w), 1e-6))
            served_durations.setdefault(key, []).append(dur)
    per = []
    for key, model in models.items():
        s = np.asarray(served_ratios.get(key, []))
        r = np.asarray(inproc_ratios[key])
        per.append(
            {
                "window": key[0],
                "kind": key[1],
                "model": model.to_dict(),
                "inproc_steps": int(r.size),
                "inproc_ratio_p50": pct(r, 50),
                "inproc_ratio_p95": pct(r, 95),
                "served_steps": int(s.size),
                "served_steps_outside_fit_range": outside.get(key, 0),
                "served_ratio_p50": pct(s, 50),
                "served_ratio_p95": pct(s, 95),
                "served_ratio_max": float(s.max()) if s.size else None,
            }
        )
    all_served = np.concatenate([np.asarray(v) for v in served_ratios.values()] or [np.zeros(0)])
    all_inproc = np.concatenate([np.asarray(v) for v in inproc_ratios.values()] or [np.zeros(0)])
    prefill_served = np.concatenate(
        [np.asarray(v) for k, v in served_ratios.items() if k[1] == "prefill"] or [np.zeros(0)]
    )
    st = store["steps"].sort_values("step")
    consecutive = np.diff(st["step"].to_numpy()) == 1
    served_gap = ((st["start_ns"].to_numpy()[1:] - st["end_ns"].to_numpy()[:-1]) / 1e6)[consecutive]
    ip_gap = np.array(
        [
            (b.start_ns - a.end_ns) / 1e6
            for a, b in zip(events, events[1:], strict=False)
            if b.step == a.step + 1
        ]
    )
    return {
        "between_steps_ms": {
            "served_p50": pct(served_gap, 50),
            "served_p95": pct(served_gap, 95),
            "served_max": float(served_gap.max()) if served_gap.size else None,
            "inproc_p50": pct(ip_gap, 50),
            "inproc_p95": pct(ip_gap, 95),
            "inproc_max": float(ip_gap.max()) if ip_gap.size else None,
        },
        "per_window_kind": per,
        "served_ratio_p50": pct(all_served, 50),
        "served_ratio_p95": pct(all_served, 95),
        "served_prefill_ratio_p50": pct(prefill_served, 50),
        "served_prefill_ratio_p95": pct(prefill_served, 95),
        "inproc_ratio_p50": pct(all_inproc, 50),
        "inproc_ratio_p95": pct(all_inproc, 95),
        "served_steps": int(all_served.size),
        "served_steps_outside_fit_range": int(sum(outside.values())),
    }


def wait_by_step(trace: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds each step's threads spent runnable but not running (Linux schedstat)."""
    return {r["step"]: r["runq_wait_ns"] / 1e9 for r in trace if r.get("step") is not None}


def trace_summary(trace: list[dict[str, Any]], step_kinds: dict[int, str]) -> dict[str, Any]:
    """Per step kind: how much of the step's wall time its threads waited for a CPU, its CPU
    utilisation (process CPU / wall), GC time."""
    out: dict[str, Any] = {}
    for kind in ("decode", "prefill"):
        recs = [r for r in trace if r.get("step") is not None and step_kinds.get(r["step"]) == kind]
        if not recs:
            continue
        wall = np.array([r["wall_ns"] for r in recs], dtype=np.float64)
        out[kind] = {
            "steps": len(recs),
            "wall_ms_p50": pct(wall / 1e6, 50),
            "cpu_per_wall_p50": pct(np.array([r["cpu_ns"] for r in recs]) / wall, 50),
            "runq_wait_per_wall_p50": pct(np.array([r["runq_wait_ns"] for r in recs]) / wall, 50),
            "runq_wait_per_wall_p95": pct(np.array([r["runq_wait_ns"] for r in recs]) / wall, 95),
            "nivcsw_per_step_mean": float(np.mean([r["nivcsw"] for r in recs])),
            "gc_ms_total": float(sum(r["gc_ns"] for r in recs) / 1e6),
            "gc_ms_max": float(max(r["gc_ns"] for r in recs) / 1e6),
            "gc_count": int(sum(r["gc_count"] for r in recs)),
        }
        sends = [r["send_ns"] / 1e6 for r in recs if "send_ns" in r]
        if sends:
            out[kind]["send_ms_p50"] = pct(sends, 50)
            out[kind]["send_ms_max"] = float(max(sends))
    return out


def inproc_windows(inproc: dict[str, Any]) -> list[dict[str, Any]]:
    """In-process engine-side latencies per window (token times = step end times)."""
    events = inproc["steps"]
    bnd = inproc["boundaries"] + [10**12]
    rows = []
    last: dict[str, float] = {}
    per_window_itl: dict[int, list[float]] = {}
    for e in events:
        w = next((i for i in range(len(bnd) - 1) if bnd[i] <= e.step < bnd[i + 1]), None)
        for c in e.chunks:
            if not c.produced_token:
                continue
            prev = last.get(c.request_id)
            last[c.request_id] = e.end_ns
            if prev is not None and c.kind == "decode" and w is not None and c.num_tokens == 1:
                per_window_itl.setdefault(w, []).append((e.end_ns - prev) / 1e6)
    for i, label in enumerate(inproc["labels"]):
        itl = np.asarray(per_window_itl.get(i, []))
        rows.append(
            {
                "window": label,
                "decode_gap_n": int(itl.size),
                "decode_gap_p50_ms": pct(itl, 50),
                "decode_gap_p999_ms": pct(itl, 99.9),
                "decode_gap_max_ms": float(itl.max()) if itl.size else None,
            }
        )
    return rows
