"""The stall story's report: the picture, the targets as ratios against the first window and
the table of docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def plot(
    path: Path,
    served: dict[str, Any],
    bounds: list[tuple[str, float, float]],
    title: str,
    client_rows: list[dict[str, Any]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = bounds[0][1]
    xs, ys = [], []
    for r in served["requests"]:
        if r.traffic_class != "chat" or r.error or len(r.chunk_times) < 2:
            continue
        t = np.asarray(r.chunk_times)
        xs.extend((t[1:] - t0).tolist())
        ys.extend((np.diff(t) * 1e3).tolist())
    rag_sent = [r.sent - t0 for r in served["requests"] if r.traffic_class == "rag"]
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=120)
    gaps = np.asarray(ys)
    tall = gaps >= 1000  # a stall: every chat stream's gap ends at once, so its dots coincide
    ax.scatter(
        np.asarray(xs)[~tall],
        gaps[~tall],
        s=4,
        alpha=0.45,
        color="#1f77b4",
        linewidths=0,
        label="chat token gap",
    )
    ax.scatter(
        np.asarray(xs)[tall],
        gaps[tall],
        s=36,
        color="#d62728",
        edgecolors="white",
        linewidths=0.5,
        label="chat token gap over 1 s",
    )
    ax.set_yscale("log")
    ax.set_xlim(-2, bounds[-1][2] - t0)
    ax.set_ylim(1, max(ys + [10]) * 6)
    ax.scatter(
        rag_sent,
        [1.25] * len(rag_sent),
        marker="^",
        s=30,
        color="#2ca02c",
        label="RAG prompt sent",
    )
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_xlabel("seconds since the first window")
    ax.set_ylabel("chat inter-token latency (ms, client)")
    for (label, lo, hi), row in zip(bounds, client_rows, strict=True):
        ax.axvline(lo - t0, color="#7f0000", lw=1.2)
        name = f"budget {label}" if label != "unchunked" else "policy unchunked"
        mx = row["chat_itl_max_ms"]
        ax.text(
            lo - t0 + 0.3,
            ax.get_ylim()[1] / 1.25,
            f"{name}\nmax {mx:,.0f} ms" if mx else name,
            color="#7f0000",
            fontsize=9,
            va="top",
        )
        if mx:
            ax.hlines(mx, lo - t0, hi - t0, colors="#ff7f0e", lw=1, linestyles="dashed")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def targets(client: list[dict[str, Any]], engine: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as ratios against the first window."""
    out: dict[str, Any] = {}
    for side, rows in (("client", client), ("engine", engine)):
        base = rows[0]
        for row in rows[1:]:
            key = f"{side}_{row['window']}"
            out[key] = {
                "max_itl_reduction": _ratio(base["chat_itl_max_ms"], row["chat_itl_max_ms"]),
                "p999_itl_reduction": _ratio(base["chat_itl_p999_ms"], row["chat_itl_p999_ms"]),
                "throughput_ratio": _ratio(row["output_tokens_per_s"], base["output_tokens_per_s"]),
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def markdown_table(result: dict[str, Any]) -> str:
    """The table of docs/benchmarks.md: client (SSE) / engine (stored) per chat ITL figure."""
    head = (
        "| window | chat ITL p50 | p99 | p99.9 | max | chat TPOT p50 / p99 | RAG TTFT p50 / p99 "
        "| chat TTFT p50 / p99 | output tok/s |\n| --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |"
    )
    lines = [head]
    for c, e in zip(result["client"], result["engine"], strict=True):
        name = f"budget {c['window']}" if c["window"] != "unchunked" else "`unchunked`"
        cells = [name]
        for key in ("chat_itl_p50_ms", "chat_itl_p99_ms", "chat_itl_p999_ms", "chat_itl_max_ms"):
            cells.append(f"{_ms(c[key])} / {_ms(e[key])}")
        cells.append(f"{_ms(c['chat_tpot_p50_ms'])} / {_ms(c['chat_tpot_p99_ms'])}")
        cells.append(f"{_ms(c['rag_ttft_p50_ms'])} / {_ms(c['rag_ttft_p99_ms'])}")
        cells.append(f"{_ms(c['chat_ttft_p50_ms'])} / {_ms(c['chat_ttft_p99_ms'])}")
        cells.append(f"{c['output_tokens_per_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(result: dict[str, Any]) -> None:
    from benchmarks._common import table

    for side in ("client", "engine"):
        rows = [
            [
                r["window"],
                r["chat_itl_p50_ms"],
                r["chat_itl_p99_ms"],
                r["chat_itl_p999_ms"],
                r["chat_itl_max_ms"],
                r["chat_tpot_p50_ms"],
                r["chat_tpot_p99_ms"],
                r["rag_ttft_p50_ms"],
                r["rag_ttft_p99_ms"],
                r["output_tokens_per_s"],
            ]
            for r in result[side]
        ]
        print(f"\n{side}:")
        print(
            table(
                rows,
                [
                    "window",
                    "itl p50",
                    "p99",
                    "p99.9",
                    "max",
                    "tpot p50",
                    "p99",
                    "rag ttft p50",
                    "p99",
                    "tok/s",
                ],
            )
        )
    for key in ("cost_model", "cost_model_minus_cpu_wait"):
        cm = result.get(key)
        if cm:
            print(
                f"\n{key}: served/predicted step time: p50 {cm['served_ratio_p50']:.2f} "
                f"p95 {cm['served_ratio_p95']:.2f} (in-process vs its own fit: p50 "
                f"{cm['inproc_ratio_p50']:.2f} p95 {cm['inproc_ratio_p95']:.2f}); between "
                f"steps p50/p95 served {cm['between_steps_ms']['served_p50']:.2f}/"
                f"{cm['between_steps_ms']['served_p95']:.2f} ms, in-process "
                f"{cm['between_steps_ms']['inproc_p50']:.2f}/"
                f"{cm['between_steps_ms']['inproc_p95']:.2f} ms"
            )
    for row in result["process_cpu"]:
        print(row)
    print("\n" + markdown_table(result))
    print(json.dumps(result["targets"], indent=1))
    print(json.dumps(result.get("served_trace"), indent=1))
    print(json.dumps(result.get("inproc_trace"), indent=1))
