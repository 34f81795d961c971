"""Summaries per traffic class and overall (formulas in loadgen/README.md).

Percentiles are numpy's linear interpolation. Rates divide by the run window W = last response
end - first send (wall clock), the same W for every class so class rates add up to the overall.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.record import RequestRecord

logger = logging.getLogger(__name__)

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None  # applies to the request's TPOT (its mean inter-token time)

    def met(self, r: RequestRecord) -> bool:
        if r.status != "ok" or r.ttft_s is None:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1000.0 > self.ttft_ms:
            return False
        if self.itl_ms is not None and r.tpot_s is not None and r.tpot_s * 1000.0 > self.itl_ms:
            return False
        return True


def stats_ms(values: list[float]) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p99, max of seconds values, reported in milliseconds."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in QUANTILES}, "max": None}
    a = np.asarray(values, dtype=float) * 1000.0
    qs = np.percentile(a, QUANTILES)
    out: dict[str, float | int | None] = {"count": int(a.size), "mean": float(a.mean())}
    out.update({f"p{q}": float(v) for q, v in zip(QUANTILES, qs, strict=True)})
    out["max"] = float(a.max())
    return out


def _dist(values: list[int]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "sum": 0, "mean": None, "p50": None, "p90": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {
        "count": int(a.size),
        "sum": int(a.sum()),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": int(a.max()),
    }


def window_s(records: list[RequestRecord]) -> float:
    starts = [r.send_wall for r in records if r.send_wall is not None]
    ends = [
        r.send_wall + r.e2e_s for r in records if r.send_wall is not None and r.e2e_s is not None
    ]
    if not starts or not ends:
        return 0.0
    return max(max(ends) - min(starts), 1e-9)


def summarize(records: list[RequestRecord], slo: Slo, window: float) -> dict[str, Any]:
    ok = [r for r in records if r.status == "ok"]
    errors: dict[str, int] = {}
    for r in records:
        if r.status == "error":
            kind = (r.error or "unknown").split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    good = [r for r in ok if slo.met(r)]
    out_tok = sum(r.output_tokens or 0 for r in ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    good_tok = sum(r.output_tokens or 0 for r in good)

    def per_s(x: float) -> float | None:
        return x / window if window > 0 else None

    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": errors,
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "queue_ms": stats_ms([r.queue_s for r in records if r.queue_s is not None]),
        "prompt_tokens": _dist([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "output_tokens": _dist([r.output_tokens for r in ok if r.output_tokens is not None]),
        "upload_bytes": _dist([r.upload_bytes for r in records if r.sent_s is not None]),
        "throughput": {
            "window_s": window,
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(out_tok),
            "total_tokens_per_s": per_s(in_tok + out_tok),
        },
        "goodput": {
            "slo_ttft_ms": slo.ttft_ms,
            "slo_itl_ms": slo.itl_ms,
            "requests_meeting_slo": len(good),
            "fraction_of_requests": len(good) / len(records) if records else None,
            "requests_per_s": per_s(len(good)),
            "output_tokens_per_s": per_s(good_tok),
        },
    }


def summarize_all(records: list[RequestRecord], slo: Slo) -> dict[str, Any]:
    w = window_s(records)
    classes = sorted({r.traffic_class for r in records})
    return {
        "overall": summarize(records, slo, w),
        "classes": {
            c: summarize([r for r in records if r.traffic_class == c], slo, w) for c in classes
        },
    }
