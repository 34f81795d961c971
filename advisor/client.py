"""What the client adds: the delivery of tokens from the engine to a streaming client.

The store holds the engine's times; a load generator measures on the client, after the HTTP
server, the SSE stream and its own scheduling. A ``python -m loadgen --out`` result against
chunkscope carries both for every request (its ``chunkscope`` block has the engine's arrival and
token times), so the difference can be measured once and added to a prediction:

- TTFT: client TTFT minus the engine's (first token time minus arrival), per request;
- ITL: each client gap minus the engine's gap between the same two tokens (the jitter of the
  delivery; measured and reported, added to predicted gaps only on request, see ``ClientDraw``).

Both are kept as evenly spaced quantiles (``inverted_cdf``: values that were measured), so a
uniform draw from them is a draw from the measured distribution. Plain numpy, no engine.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from advisor.quantiles import mass_quantiles

logger = logging.getLogger(__name__)

QUANTILES = 400


@dataclass(frozen=True)
class ClientDelay:
    ttft_offsets_s: list[float]
    itl_deltas_s: list[float]
    num_requests: int
    num_gaps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClientDelay:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def summary(self) -> dict[str, float | int | None]:
        def pct(v: list[float], q: float) -> float | None:
            return float(np.percentile(v, q)) * 1e3 if v else None

        return {
            "num_requests": self.num_requests,
            "num_gaps": self.num_gaps,
            "ttft_offset_p50_ms": pct(self.ttft_offsets_s, 50),
            "ttft_offset_p90_ms": pct(self.ttft_offsets_s, 90),
            "itl_delta_p1_ms": pct(self.itl_deltas_s, 1),
            "itl_delta_p50_ms": pct(self.itl_deltas_s, 50),
            "itl_delta_p99_ms": pct(self.itl_deltas_s, 99),
        }


def client_delay(result: Mapping[str, Any]) -> ClientDelay:
    """From a loadgen result document (its ``requests`` with their ``server`` blocks)."""
    ttft: list[float] = []
    deltas: list[float] = []
    n_req = 0
    for r in result.get("requests") or []:
        s = r.get("server") or {}
        times = s.get("token_times") or []
        arrival = s.get("arrival_time")
        if r.get("ttft_s") is None or not times or arrival is None:
            continue
        n_req += 1
        ttft.append(float(r["ttft_s"]) - (float(times[0]) - float(arrival)))
        itl = r.get("itl_s") or []
        if len(r.get("chunk_wall") or []) == len(times):  # one chunk per token
            for j, gap in enumerate(itl):
                deltas.append(float(gap) - (float(times[j + 1]) - float(times[j])))
    if not ttft:
        raise ValueError(
            "the load generator result has no request with the engine's token times (a "
            "`chunkscope` block): run it against chunkscope"
        )
    out = ClientDelay(
        mass_quantiles(ttft, QUANTILES), mass_quantiles(deltas, QUANTILES), n_req, len(deltas)
    )
    logger.info("client delivery: %s", out.summary())
    return out


def load_client_delay(path: str | Path) -> ClientDelay:
    return client_delay(json.loads(Path(path).read_text()))


class ClientDraw:
    """Seeded draws of a TTFT offset and (when ``gaps``) of a gap delta.

    Gap deltas are off by default: the client's slow deliveries come with the engine's own slow
    steps (the same processes share the cores), so adding a delta drawn independently to every
    simulated gap counts the tail twice. In our runs on the 2-core machine the client's p99 gap
    was within 1-8 ms of the engine's, while independent deltas added 20-40 ms to the predicted
    p99; the TTFT offset (request parsing, admission, the first chunk's delivery) has no such
    overlap and is added."""

    def __init__(self, delay: ClientDelay, seed: int = 0, *, gaps: bool = False) -> None:
        self.delay = delay
        self.rng = random.Random(seed)
        self.gaps = gaps

    def ttft(self, engine_s: float) -> float:
        v = self.delay.ttft_offsets_s
        return max(0.0, engine_s + (self.rng.choice(v) if v else 0.0))

    def gap(self, engine_s: float) -> float:
        v = self.delay.itl_deltas_s
        if not self.gaps or not v:
            return engine_s
        return max(0.0, engine_s + self.rng.choice(v))
