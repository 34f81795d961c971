"""Trace replay: Azure LLM inference CSV and Mooncake-style JSONL -> request plan.

- Azure (Azure/AzurePublicDataset, CC-BY-4.0): CSV `TIMESTAMP, ContextTokens, GeneratedTokens`,
  timestamps like `2023-11-16 18:15:46.6805900`; no prefix information (unique prompts).
- Mooncake (kvcache-ai/Mooncake traces): JSON lines `{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [..]}`; hash id i stands for the i-th block of `block_size`
  prompt tokens (512 in Mooncake), so equal hash ids become identical token blocks.

Offsets are (t - t_first) * time_scale (0.5 replays twice as fast). Lengths are clipped to the
server context. Unparseable rows are skipped, counted and logged, never silently.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from loadgen.spec import RequestSpec, fit_context, reindex
from loadgen.tokens import Segment

logger = logging.getLogger(__name__)

FORMATS = ("auto", "azure", "mooncake")
MAX_ROWS = 5_000_000


@dataclass
class TraceRow:
    offset_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


@dataclass
class Trace:
    fmt: str
    rows: list[TraceRow] = field(default_factory=list)
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1


def detect_format(path: Path) -> str:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        first = f.readline().strip()
    if first.startswith("{"):
        return "mooncake"
    if "contexttokens" in first.lower().replace(" ", ""):
        return "azure"
    raise ValueError(f"cannot tell the trace format of {path} (use --trace-format)")


def _finish(trace: Trace, stamps: list[float], time_scale: float) -> Trace:
    if stamps:
        t0 = min(stamps)
        for row, ts in zip(trace.rows, stamps, strict=True):
            row.offset_s = (ts - t0) * time_scale
        trace.rows.sort(key=lambda r: r.offset_s)
    if trace.skipped:
        logger.warning("trace: skipped %d bad rows: %s", trace.skipped, trace.skip_reasons)
    return trace


def parse_azure(path: Path, time_scale: float = 1.0, limit: int | None = None) -> Trace:
    trace, stamps = Trace("azure"), []
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = [h.strip().lower() for h in next(reader, [])]
        try:
            i_ts, i_in, i_out = (
                header.index(k) for k in ("timestamp", "contexttokens", "generatedtokens")
            )
        except ValueError as exc:
            raise ValueError(f"{path}: not an Azure trace header: {header}") from exc
        for n, rec in enumerate(reader):
            if n >= MAX_ROWS or (limit is not None and len(trace.rows) >= limit):
                break
            try:
                ts = datetime.fromisoformat(rec[i_ts].strip()).timestamp()
                inp, out = int(rec[i_in]), int(rec[i_out])
            except (ValueError, IndexError):
                trace.skip("unparseable row")
                continue
            if inp < 1 or out < 1:
                trace.skip("non-positive length")
                continue
            stamps.append(ts)
            trace.rows.append(TraceRow(0.0, inp, out))
    return _finish(trace, stamps, time_scale)


def parse_mooncake(path: Path, time_scale: float = 1.0, limit: int | None = None) -> Trace:
    trace, stamps = Trace("mooncake"), []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f):
            if n >= MAX_ROWS or (limit is not None and len(trace.rows) >= limit):
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"]) / 1000.0
                inp, out = int(rec["input_length"]), int(rec["output_length"])
                hashes = tuple(int(h) for h in rec.get("hash_ids") or ())
            except (ValueError, KeyError, TypeError, AttributeError):
                trace.skip("unparseable row")
                continue
            if inp < 1 or out < 1:
                trace.skip("non-positive length")
                continue
            stamps.append(ts)
            trace.rows.append(TraceRow(0.0, inp, out, hashes))
    return _finish(trace, stamps, time_scale)


def load_trace(
    path: str | Path, fmt: str = "auto", time_scale: float = 1.0, limit: int | None = None
) -> Trace:
    p = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"trace format must be one of {FORMATS}")
    if not time_scale > 0:
        raise ValueError("time scale must be > 0")
    fmt = detect_format(p) if fmt == "auto" else fmt
    parse = parse_azure if fmt == "azure" else parse_mooncake
    return parse(p, time_scale, limit)


def trace_specs(
    trace: Trace,
    ctx: int,
    *,
    block_size: int = 512,
    duration: float | None = None,
    num_requests: int | None = None,
    traffic_class: str = "trace",
) -> list[RequestSpec]:
    """Requests for the trace rows within duration / count; hash blocks become shared segments."""
    specs: list[RequestSpec] = []
    for i, row in enumerate(trace.rows):
        if duration is not None and row.offset_s >= duration:
            break
        if num_requests is not None and len(specs) >= num_requests:
            break
        budget, out = fit_context(row.input_len, row.output_len, ctx)
        segs: list[Segment] = []
        if row.hash_ids:
            left = budget
            for h in row.hash_ids:
                if left <= 0:
                    break
                take = min(block_size, left)
                segs.append(Segment(f"mc/{h}", take, shared=True))
                left -= take
            if left > 0:
                segs.append(Segment(f"trace/u{i}", left))
        else:
            segs.append(Segment(f"trace/u{i}", budget))
        meta = {"trace_input": row.input_len, "trace_output": row.output_len}
        specs.append(RequestSpec(i, traffic_class, row.offset_s, out, tuple(segs), meta=meta))
    return reindex(specs)
