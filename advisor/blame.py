"""The blame ledger: who slowed a request, and by how much. No torch, no I/O.

Every gap before one of a request's tokens (the first one: from its arrival) is split into

- **own**: its own chunk's cost in each step of the gap plus the step's fixed cost (the
  constant, and the multi-row cost when the step had several rows): what the steps would have
  cost with only its own work in them;
- **pause**: the time between steps (the engine's own overhead, which it pays alone too);
- **excess**: the rest of the steps' time, attributed to the other requests in them.

Each step's measured duration ``d`` is shared out in proportion to the fitted step-cost model
(``engine.core.cost_model``): a chunk's marginal cost ``m`` is its prefill or decode tokens times
their cost, plus its attention pairs (by its own context) times theirs, plus its image tokens;
the step's prediction is ``p = const + multi_row + sum(m)``, and every part is scaled by
``d / p``, so a step slower than the model said is slower for every part of it alike. The parts
of every gap therefore add up to the measured gap, exactly::

    request r   tok ───────────────────── gap ───────────────────── tok
    steps           [ r 1 + q 2,048 prefill ]  pause  [ r 1 + q 2,048 ]
    parts           own(r) + excess → q           pause   own(r) + excess → q

How the excess of one step is shared among the others:

- r had a chunk in the step: by each other chunk's marginal cost;
- r had arrived while the step ran (it was in flight): the part of the step after the arrival,
  by marginal cost;
- r waited a whole step without a chunk (queued: the budget was taken, or it was preempted):
  the whole step, by the tokens each other request held of the budget.

Only the first-order cost is counted: a culprit that is removed also lets the others finish
sooner and changes what the scheduler plans later, which this does not model
(``benchmarks/blame.py`` measures how close it comes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from engine.core.cost_model import CostModel

# a gap is a stall when its excess is at least this share of the gap (the gap is at least
# twice what the request's own work and the pauses took) and at least STALL_MIN_MS
STALL_SHARE = 0.5
STALL_MIN_MS = 5.0

_SHARED, _IN_FLIGHT, _QUEUED = 0, 1, 2


class BlameError(ValueError):
    """A ledger that cannot be computed (the message says why)."""


@dataclass(frozen=True)
class Window:
    """One run's steps, chunks and requests over a window, as ``storage.queries`` returns them.

    ``steps``: ``step``, ``start_ns``, ``end_ns`` (and ``start``, wall seconds); ``chunks``:
    ``step``, ``request_id``, ``kind``, ``start``, ``num_tokens``, ``produced_token``;
    ``requests``: ``request_id``, ``traffic_class``, ``num_prompt_tokens``,
    ``num_image_tokens``, ``arrival`` and ``finished`` (wall seconds)."""

    engine_id: str
    run_id: str
    steps: pd.DataFrame
    chunks: pd.DataFrame
    requests: pd.DataFrame


def _lookup(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``keys`` is in ``sorted_keys``: (found, position; 0 where not found)."""
    if len(sorted_keys) == 0:
        return np.zeros(len(keys), dtype=bool), np.zeros(len(keys), dtype=np.int64)
    pos = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    hit = sorted_keys[pos] == keys
    return hit, np.where(hit, pos, 0)


def _f(x: Any) -> float | None:
    """A JSON-safe float (None for missing)."""
    if x is None:
        return None
    v = float(x)
    return None if v != v else v


class Ledger:
    """The ledger of one window: every (request, step) it spent waiting in, with its parts.

    Built once per window (vectorised: a minute of a busy engine in well under a second); the
    per-request and per-culprit answers are views of it."""

    def __init__(self, window: Window, model: CostModel) -> None:
        self.window = window
        self.model = model
        steps = window.steps.sort_values("step", kind="stable").reset_index(drop=True)
        if steps.empty or window.chunks.empty:
            raise BlameError("no steps in the window")
        self.steps = steps
        self.step_no = steps["step"].to_numpy(dtype=np.int64)
        self.start = steps["start_ns"].to_numpy(dtype=np.int64)
        self.end = steps["end_ns"].to_numpy(dtype=np.int64)
        self.dur = np.maximum(self.end - self.start, 0).astype(np.float64)
        # wall seconds = ns / 1e9 + offset (the run's clock anchor, read back from the steps)
        self._offset = float(
            np.median(steps["start"].to_numpy(dtype=np.float64) - self.start / 1e9)
        )
        self._requests(window.requests, window.chunks)
        self._chunks(window.chunks)
        self._pairs()

    # ---- building ---------------------------------------------------------------------------

    def _requests(self, reqs: pd.DataFrame, chunks: pd.DataFrame) -> None:
        reqs = reqs.drop_duplicates("request_id", keep="last")
        both = np.concatenate(
            [reqs["request_id"].to_numpy(dtype=object), chunks["request_id"].to_numpy(dtype=object)]
        )
        codes, uniques = pd.factorize(both)
        self.ids = np.asarray(uniques, dtype=object)
        self.index = {str(rid): i for i, rid in enumerate(self.ids)}
        nr, k = len(self.ids), len(reqs)
        self._chunk_codes = codes[k:]

        def column(name: str, fill: Any) -> np.ndarray:
            out = np.full(nr, fill, dtype=object if fill is None else np.float64)
            if k:
                values = reqs[name].to_numpy(dtype=object if fill is None else np.float64)
                out[codes[:k]] = values
            return out

        self.cls = column("traffic_class", None)
        self.prompt = column("num_prompt_tokens", np.nan)
        image = np.nan_to_num(column("num_image_tokens", np.nan))
        self.image_share = np.where(
            (image > 0) & (self.prompt > 0), np.minimum(1.0, image / np.maximum(self.prompt, 1)), 0
        )
        self.arrival_ns = self._to_ns(column("arrival", np.nan))
        self.finished_ns = self._to_ns(column("finished", np.nan))

    def _to_ns(self, wall: np.ndarray) -> np.ndarray:
        return np.round((wall - self._offset) * 1e9)  # float: NaN where unknown

    def _chunks(self, chunks: pd.DataFrame) -> None:
        m = self.model
        step_idx = np.searchsorted(self.step_no, chunks["step"].to_numpy(dtype=np.int64))
        ok = (step_idx < len(self.step_no)) & (
            self.step_no[np.minimum(step_idx, len(self.step_no) - 1)]
            == chunks["step"].to_numpy(dtype=np.int64)
        )
        c = chunks[ok]
        self.c_step = step_idx[ok]
        self.c_req = self._chunk_codes[ok].astype(np.int64)
        n = c["num_tokens"].to_numpy(dtype=np.float64)
        s = c["start"].to_numpy(dtype=np.float64)
        decode = (c["kind"] == "decode").to_numpy()
        pairs = n * s + n * (n + 1) / 2
        image = np.where(decode, 0.0, n * self.image_share[self.c_req])
        self.c_n = n
        self.c_produced = c["produced_token"].to_numpy(dtype=bool)
        self.c_m = (
            np.where(decode, m.decode * n, m.prefill * n)
            + m.attn * pairs
            + np.where(decode, m.attn_decode * pairs, 0.0)
            + m.vision * image
        )
        ns = len(self.step_no)
        self.M = np.bincount(self.c_step, self.c_m, minlength=ns)
        self.T = np.bincount(self.c_step, n, minlength=ns)
        self.quiet = m.const + np.where(self.T >= 2, m.multi_row, 0.0)
        self.pred = self.quiet + self.M
        self.scale = np.where(self.pred > 0, self.dur / np.where(self.pred > 0, self.pred, 1), 0)

    def _pairs(self) -> None:
        """Every (request, step) of the window that lay in one of the request's gaps."""
        ns, nr = len(self.step_no), len(self.ids)
        # own chunk per (request, step), summed (one per step in practice)
        key = self.c_req * ns + self.c_step
        ukey, inv = np.unique(key, return_inverse=True)
        own_m = np.bincount(inv, self.c_m)
        own_n = np.bincount(inv, self.c_n)
        own_prod = np.bincount(inv, self.c_produced.astype(np.float64)) > 0
        # from arrival (the first step that ends after it) to the last token (or the window's
        # end when the request had not finished by then)
        first_chunk = np.full(nr, ns, dtype=np.int64)
        np.minimum.at(first_chunk, self.c_req, self.c_step)
        last_tok = np.full(nr, -1, dtype=np.int64)
        np.maximum.at(last_tok, self.c_req[self.c_produced], self.c_step[self.c_produced])
        arrival = np.where(
            np.isnan(self.arrival_ns),
            self.start[np.minimum(first_chunk, ns - 1)],
            self.arrival_ns,
        )
        arrival = np.maximum(arrival, self.start[0])  # a window cut: its first gap is partial
        self.arrival = arrival
        done = ~np.isnan(self.finished_ns) & (self.finished_ns <= self.end[-1])
        i0 = np.searchsorted(self.end, arrival, side="right")
        i1 = np.where(done & (last_tok >= 0), last_tok, ns - 1)
        i1 = np.where(
            done & (last_tok < 0), np.searchsorted(self.end, self.finished_ns, "right") - 1, i1
        )
        length = np.maximum(i1 - i0 + 1, 0)
        req = np.repeat(np.arange(nr), length)
        offs = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
        step = np.repeat(i0, length) + offs
        pkey = req * ns + step
        hit, pos = _lookup(ukey, pkey)
        p_own_m = np.where(hit, own_m[pos], 0.0)
        p_own_n = np.where(hit, own_n[pos], 0.0)
        p_prod = hit & own_prod[pos]
        has = p_own_n > 0
        a = arrival[req]
        in_flight = ~has & (self.start[step] < a)
        dur = self.dur[step]
        frac = np.where(
            self.start[step] < a,
            np.clip((self.end[step] - a) / np.where(dur > 0, dur, 1), 0, 1),
            1.0,
        )
        own_pred = np.where(has, self.quiet[step] + p_own_m, 0.0)
        others = np.maximum(self.pred[step] - own_pred, 0.0)
        k = self.scale[step]
        self.p_req, self.p_step, self.p_prod = req, step, p_prod
        self.p_own = k * own_pred * frac / 1e6  # ms
        self.p_excess = k * others * frac / 1e6
        self.p_wall = dur * frac / 1e6  # the part of the step inside the gap
        self.p_mode = np.where(has, _SHARED, np.where(in_flight, _IN_FLIGHT, _QUEUED))
        # what one unit of another chunk's cost (x) or tokens (y) takes of this pair's excess
        denom_cost = np.where(has, self.M[step] - p_own_m, self.M[step])
        cost_w = (self.p_mode != _QUEUED) & (denom_cost > 0)
        tok_w = (self.p_mode == _QUEUED) & (self.T[step] > 0)
        self.p_x = np.where(cost_w, self.p_excess / np.where(cost_w, denom_cost, 1), 0.0)
        self.p_y = np.where(tok_w, self.p_excess / np.where(tok_w, self.T[step], 1), 0.0)
        # gaps: a pair leads to the request's next token (k counts within the window)
        order = np.lexsort((step, req))
        assert np.all(order == np.arange(len(order))), "pairs are built sorted"
        before = np.concatenate([[0], np.cumsum(p_prod.astype(np.int64))])
        starts = np.cumsum(length) - length
        self.p_k = before[:-1] - np.repeat(before[starts], length) + 1
        # chunk -> its own pair (for the culprit's own term in the aggregates)
        self._pair_key = pkey

    # ---- answers ----------------------------------------------------------------------------

    def wall(self, t_ns: Any) -> Any:
        return np.asarray(t_ns, dtype=np.float64) / 1e9 + self._offset

    def _culprit_rows(
        self, pair_sel: np.ndarray, chunk_sel: np.ndarray | None = None
    ) -> pd.DataFrame:
        """(victim, culprit, step, ms, mode) for the selected pairs against every other chunk
        of their steps (or only ``chunk_sel``'s)."""
        pair, chunk, ms = self._culprit_arrays(pair_sel, chunk_sel)
        return pd.DataFrame(
            {
                "victim": self.p_req[pair],
                "culprit": self.c_req[chunk],
                "step": self.p_step[pair],
                "ms": ms,
                "mode": self.p_mode[pair],
                "pair": pair,
            }
        )

    def _culprit_arrays(
        self, pair_sel: np.ndarray, chunk_sel: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_culprit_rows`` as arrays: (pair, chunk, ms), one row per other request's chunk
        in the pair's step."""
        pi = np.flatnonzero(pair_sel)
        ci = np.arange(len(self.c_step)) if chunk_sel is None else np.flatnonzero(chunk_sel)
        if pi.size == 0 or ci.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0)
        ci = ci[np.argsort(self.c_step[ci], kind="stable")]
        cs = self.c_step[ci]
        lo = np.searchsorted(cs, self.p_step[pi], "left")
        hi = np.searchsorted(cs, self.p_step[pi], "right")
        cnt = hi - lo
        pair = np.repeat(pi, cnt)
        offs = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        chunk = ci[np.repeat(lo, cnt) + offs]
        keep = self.p_req[pair] != self.c_req[chunk]
        pair, chunk = pair[keep], chunk[keep]
        return pair, chunk, self.c_m[chunk] * self.p_x[pair] + self.c_n[chunk] * self.p_y[pair]

    def request_info(self, i: int) -> dict[str, Any]:
        prompt = self.prompt[i]
        return {
            "request_id": str(self.ids[i]),
            "traffic_class": None if pd.isna(self.cls[i]) else str(self.cls[i]),
            "num_prompt_tokens": None if prompt != prompt else int(prompt),
        }

    def gaps(self, request_id: str) -> pd.DataFrame:
        """One row per gap of the request: ``k`` (the token it led to; 1 is the TTFT), wall
        ``begin`` / ``end``, ``gap_ms`` = ``own_ms`` + ``pause_ms`` + ``excess_ms``,
        ``queue_ms`` (the part of the excess spent without a chunk), ``stall``, the
        ``culprit`` who took most of the excess with its ``culprit_ms``, ``steps`` (how many
        steps the gap spans), ``step`` (the engine's number of the step that ended it) and
        ``culprits`` (the largest three: a list of (request id, ms))."""
        i = self._victim(request_id)
        sel = self.p_req == i
        cols = ["k", "begin", "end", "gap_ms", "own_ms", "pause_ms", "excess_ms", "queue_ms",
                "stall", "culprit", "culprit_ms", "steps", "step", "culprits"]  # fmt: skip
        if not sel.any():
            return pd.DataFrame(columns=cols)
        df = pd.DataFrame(
            {
                "k": self.p_k[sel],
                "step": self.p_step[sel],
                "own_ms": self.p_own[sel],
                "excess_ms": self.p_excess[sel],
                "queue_ms": np.where(self.p_mode[sel] == _QUEUED, self.p_excess[sel], 0.0),
                "wall_ms": self.p_wall[sel],
                "prod": self.p_prod[sel],
            }
        )
        g = df.groupby("k", sort=True)
        out = g.agg(
            own_ms=("own_ms", "sum"),
            excess_ms=("excess_ms", "sum"),
            queue_ms=("queue_ms", "sum"),
            wall_ms=("wall_ms", "sum"),
            last=("step", "max"),
            steps=("step", "size"),
        ).reset_index()
        begin_ns = np.empty(len(out))
        end_ns = self.end[out["last"].to_numpy()].astype(np.float64)
        begin_ns[0] = self.arrival[i]
        begin_ns[1:] = end_ns[:-1]
        gap = (end_ns - begin_ns) / 1e6
        out["gap_ms"] = gap
        out["pause_ms"] = np.maximum(gap - out["wall_ms"], 0.0)
        out["begin"] = self.wall(begin_ns)
        out["end"] = self.wall(end_ns)
        out["step"] = self.step_no[out["last"].to_numpy()]
        out["stall"] = (out["excess_ms"] >= STALL_SHARE * out["gap_ms"]) & (
            out["excess_ms"] >= STALL_MIN_MS
        )
        rows = self._culprit_rows(sel)
        out["culprit"] = None
        out["culprit_ms"] = 0.0
        out["culprits"] = [[] for _ in range(len(out))]
        if not rows.empty:
            rows["k"] = self.p_k[rows["pair"].to_numpy()]
            per = rows.groupby(["k", "culprit"], as_index=False)["ms"].sum()
            ranked = per.sort_values(["k", "ms"], ascending=[True, False], kind="stable")
            three: dict[int, list[tuple[str, float]]] = {}
            head = ranked.groupby("k", sort=False).head(3)
            for k, c, ms in zip(head["k"], head["culprit"], head["ms"], strict=True):
                three.setdefault(int(k), []).append((str(self.ids[int(c)]), float(ms)))
            out["culprits"] = [three.get(k, []) for k in out["k"]]
            top = per.sort_values("ms", ascending=False).drop_duplicates("k").set_index("k")
            out["culprit"] = [
                str(self.ids[int(top.loc[k, "culprit"])]) if k in top.index else None
                for k in out["k"]
            ]
            out["culprit_ms"] = [
                float(top.loc[k, "ms"]) if k in top.index else 0.0 for k in out["k"]
            ]
        return out[cols]

    def _victim(self, request_id: str) -> int:
        i = self.index.get(str(request_id))
        if i is None:
            raise BlameError(f"request {request_id!r} has no step in the window")
        return i

    def request(self, request_id: str, *, top: int | None = None) -> dict[str, Any]:
        """What slowed one request: its measured time from arrival to its last token in the
        window, split into own work, pauses and excess, and the culprits of the excess
        (largest first). ``top`` keeps that many culprits (None: all)."""
        i = self._victim(request_id)
        gaps = self.gaps(request_id)
        sel = self.p_req == i
        rows = self._culprit_rows(sel)
        culprits: list[dict[str, Any]] = []
        if not rows.empty:
            rows["queue_ms"] = np.where(rows["mode"] == _QUEUED, rows["ms"], 0.0)
            rows["k"] = self.p_k[rows["pair"].to_numpy()]
            per = rows.groupby("culprit").agg(
                ms=("ms", "sum"), queue_ms=("queue_ms", "sum"), gaps=("k", "nunique")
            )
            per = per.sort_values("ms", ascending=False, kind="stable")
            if top is not None:
                per = per.head(top)
            for q, row in per.iterrows():
                culprits.append(
                    {
                        **self.request_info(int(q)),  # type: ignore[arg-type]
                        "ms": float(row["ms"]),
                        "queue_ms": float(row["queue_ms"]),
                        "gaps": int(row["gaps"]),
                    }
                )
        measured = float(gaps["gap_ms"].sum()) if not gaps.empty else 0.0
        ttft = gaps[gaps["k"] == 1] if not gaps.empty else gaps
        return {
            **self.request_info(i),
            "engine_id": self.window.engine_id,
            "run_id": self.window.run_id,
            "arrival": _f(self.wall(self.arrival[i])),
            "num_gaps": len(gaps),
            "num_stalls": int(gaps["stall"].sum()) if not gaps.empty else 0,
            "measured_ms": measured,
            "own_ms": float(gaps["own_ms"].sum()) if not gaps.empty else 0.0,
            "pause_ms": float(gaps["pause_ms"].sum()) if not gaps.empty else 0.0,
            "excess_ms": float(gaps["excess_ms"].sum()) if not gaps.empty else 0.0,
            "queue_ms": float(gaps["queue_ms"].sum()) if not gaps.empty else 0.0,
            "ttft_ms": _f(ttft["gap_ms"].iloc[0]) if len(ttft) else None,
            "ttft_excess_ms": _f(ttft["excess_ms"].iloc[0]) if len(ttft) else None,
            "culprits": culprits,
        }

    def costs(self) -> pd.DataFrame:
        """Per culprit: ``cost_to_others_ms`` (the excess it caused every other request in the
        window), ``queue_ms`` (of it, while they waited without a chunk), its class and
        prompt length; largest first."""
        ns = len(self.step_no)
        X = np.bincount(self.p_step, self.p_x, minlength=ns)
        Y = np.bincount(self.p_step, self.p_y, minlength=ns)
        # a culprit's own pair in its chunk's step is not a victim of itself
        self_x = np.zeros(len(self.c_step))
        self_y = np.zeros(len(self.c_step))
        if len(self._pair_key):
            hit, pos = _lookup(self._pair_key, self.c_req * ns + self.c_step)
            self_x = np.where(hit, self.p_x[pos], 0.0)
            self_y = np.where(hit, self.p_y[pos], 0.0)
        cost = self.c_m * (X[self.c_step] - self_x) + self.c_n * (Y[self.c_step] - self_y)
        queue = self.c_n * (Y[self.c_step] - self_y)
        nr = len(self.ids)
        total = np.bincount(self.c_req, cost, minlength=nr)
        queued = np.bincount(self.c_req, queue, minlength=nr)
        df = pd.DataFrame(
            {
                "request_id": self.ids.astype(str),
                "traffic_class": self.cls,
                "num_prompt_tokens": self.prompt,
                "cost_to_others_ms": total,
                "queue_ms": queued,
            }
        )
        df = df[df["cost_to_others_ms"] > 0]
        return df.sort_values("cost_to_others_ms", ascending=False, kind="stable").reset_index(
            drop=True
        )

    def offenders(self, top: int = 10) -> list[dict[str, Any]]:
        """The ``top`` requests that cost the others most: ``cost_to_others_ms``, ``victims``
        (how many requests they slowed), the ``worst_victim_ms`` one of them lost, and their
        class and prompt length."""
        if top < 1:
            raise BlameError(f"--top must be at least 1, got {top}")
        costs = self.costs().head(top)
        if costs.empty:
            return []
        ids = [self.index[r] for r in costs["request_id"]]
        rows = self._culprit_rows(np.ones(len(self.p_req), bool), np.isin(self.c_req, ids))
        per = rows.groupby(["culprit", "victim"])["ms"].sum().reset_index()
        per = per[per["ms"] > 0]
        victims = per.groupby("culprit")["victim"].nunique()
        worst = per.groupby("culprit")["ms"].max()
        out = []
        for rec, i in zip(costs.to_dict("records"), ids, strict=True):
            out.append(
                {
                    **self.request_info(i),
                    "cost_to_others_ms": float(rec["cost_to_others_ms"]),
                    "queue_ms": float(rec["queue_ms"]),
                    "victims": int(victims.get(i, 0)),
                    "worst_victim_ms": float(worst.get(i, 0.0)),
                }
            )
        return out

    def by_class(self) -> pd.DataFrame:
        """The excess each traffic class caused the others (``ms``) and its share of all of it."""
        costs = self.costs()
        if costs.empty:
            return pd.DataFrame(columns=["traffic_class", "ms", "share"])
        cls = costs["traffic_class"].fillna("unknown").astype(str)
        per = costs.groupby(cls)["cost_to_others_ms"].sum().sort_values(ascending=False)
        out = per.rename("ms").reset_index().rename(columns={"index": "traffic_class"})
        out.columns = ["traffic_class", "ms"]
        out["share"] = out["ms"] / out["ms"].sum()
        return out

    def _gap_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every gap of every request at once: each pair's gap number, and per gap its last
        pair, its excess and its length in ms (as ``gaps`` computes them one request at a
        time)."""
        n = len(self.p_req)
        # pairs are sorted by (request, step): a gap is a run of pairs with the same (req, k)
        new = np.ones(n, dtype=bool)
        new[1:] = (self.p_req[1:] != self.p_req[:-1]) | (self.p_k[1:] != self.p_k[:-1])
        gid = np.cumsum(new) - 1
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, n - 1)
        excess = np.bincount(gid, self.p_excess)
        g_req = self.p_req[first]
        end_ns = self.end[self.p_step[last]].astype(np.float64)
        begin_ns = np.empty(len(first))
        begin_ns[1:] = end_ns[:-1]
        first_of_req = np.ones(len(first), dtype=bool)
        first_of_req[1:] = g_req[1:] != g_req[:-1]
        begin_ns[first_of_req] = self.arrival[g_req[first_of_req]]
        return gid, last, excess, (end_ns - begin_ns) / 1e6

    def token_gaps(self, tokens: pd.DataFrame, top: int = 3) -> pd.DataFrame:
        """The gaps ended by some tokens (``tokens``: ``request_id`` and ``step``, the step
        that produced the token), in one pass: per token found, ``gap_ms``, ``excess_ms`` and
        ``culprits`` (the ``top`` largest, (request id, ms) each)."""
        cols = ["request_id", "step", "gap_ms", "excess_ms", "culprits"]
        if len(self.p_req) == 0 or tokens.empty:
            return pd.DataFrame(columns=cols)
        gid, last, excess, gap_ms = self._gap_index()
        ns = len(self.step_no)
        # gap -> (request, step index of its end); the tokens' keys the same way
        g_key = self.p_req[last] * ns + self.p_step[last]
        req = np.array([self.index.get(str(r), -1) for r in tokens["request_id"]], dtype=np.int64)
        pos = np.searchsorted(self.step_no, tokens["step"].to_numpy(dtype=np.int64))
        ok = (req >= 0) & (pos < ns)
        ok[ok] &= self.step_no[pos[ok]] == tokens["step"].to_numpy(dtype=np.int64)[ok]
        order = np.argsort(g_key, kind="stable")
        hit, at = _lookup(g_key[order], np.where(ok, req * ns + pos, -1))
        hit &= ok & self.p_prod[last[order[at]]]
        wanted = order[at[hit]]  # the gaps asked for
        if wanted.size == 0:
            return pd.DataFrame(columns=cols)
        sel = np.zeros(len(last), dtype=bool)
        sel[wanted] = True
        rows = self._culprit_rows(sel[gid])
        three: dict[int, list[tuple[str, float]]] = {}
        if not rows.empty:
            rows["gid"] = gid[rows["pair"].to_numpy()]
            per = rows.groupby(["gid", "culprit"], as_index=False)["ms"].sum()
            per = per.sort_values(["gid", "ms"], ascending=[True, False], kind="stable")
            per = per.groupby("gid", sort=False).head(top)
            for g, c, ms in zip(per["gid"], per["culprit"], per["ms"], strict=True):
                three.setdefault(int(g), []).append((str(self.ids[int(c)]), float(ms)))
        return pd.DataFrame(
            {
                "request_id": self.ids[self.p_req[last[wanted]]].astype(str),
                "step": self.step_no[self.p_step[last[wanted]]],
                "gap_ms": gap_ms[wanted],
                "excess_ms": excess[wanted],
                "culprits": [three.get(int(g), []) for g in wanted],
            }
        )

    def stall_links(self, min_share: float = 0.1) -> pd.DataFrame:
        """The chunks behind every stall in the window (a gap ended by one of the request's
        tokens whose excess makes it a stall): one row per (stall, culprit chunk) taking at
        least ``min_share`` of the stall's excess. ``victim``, ``k`` (the token that ended the
        gap), ``victim_step`` (the step that produced it), ``culprit``, ``culprit_step`` (the
        step its chunk ran in) and ``ms`` (what that chunk cost the victim there); largest
        first."""
        cols = ["victim", "k", "victim_step", "culprit", "culprit_step", "ms"]
        if len(self.p_req) == 0:
            return pd.DataFrame(columns=cols)
        gid, last, excess, gap_ms = self._gap_index()
        stall = (
            self.p_prod[last]  # closed by a token within the window
            & (excess >= STALL_SHARE * gap_ms)
            & (excess >= STALL_MIN_MS)
        )
        g_req = self.p_req[last]
        pair, chunk, ms = self._culprit_arrays(stall[gid])
        # a request has one chunk a step: a row below half the bar cannot reach it summed
        big = ms >= 0.5 * min_share * excess[gid[pair]]
        pair, chunk, ms = pair[big], chunk[big], ms[big]
        if ms.size == 0:
            return pd.DataFrame(columns=cols)
        rows = pd.DataFrame(
            {"gid": gid[pair], "culprit": self.c_req[chunk], "step": self.p_step[pair], "ms": ms}
        )
        per = rows.groupby(["gid", "culprit", "step"], as_index=False)["ms"].sum()
        g = per["gid"].to_numpy()
        per = per[per["ms"].to_numpy() >= min_share * excess[g]]
        g = per["gid"].to_numpy()
        out = pd.DataFrame(
            {
                "victim": self.ids[g_req[g]].astype(str),
                "k": self.p_k[last[g]],
                "victim_step": self.step_no[self.p_step[last[g]]],
                "culprit": self.ids[per["culprit"].to_numpy()].astype(str),
                "culprit_step": self.step_no[per["step"].to_numpy()],
                "ms": per["ms"].to_numpy(),
            }
        )
        return out.sort_values("ms", ascending=False, kind="stable").reset_index(drop=True)

    def totals(self) -> dict[str, float]:
        """Every pair's parts summed: ``own_ms``, ``excess_ms`` and the time of the steps inside
        gaps (``steps_ms`` = own + excess)."""
        return {
            "own_ms": float(self.p_own.sum()),
            "excess_ms": float(self.p_excess.sum()),
            "steps_ms": float(self.p_wall.sum()),
        }


def model_dict(model: CostModel, quality: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The model a ledger used, for its JSON: coefficients and fit error."""
    out: dict[str, Any] = {
        "const_ms": model.const * 1e3,
        "prefill_us_per_token": model.prefill * 1e6,
        "decode_us_per_token": model.decode * 1e6,
        "attn_ns_per_pair": model.attn * 1e9,
        "attn_decode_ns_per_pair": model.attn_decode * 1e9,
        "vision_us_per_token": model.vision * 1e6,
        "multi_row_ms": model.multi_row * 1e3,
        "rel_err_p50": model.rel_err_p50,
    }
    if quality:
        out["poor"] = bool(quality.get("poor"))
        out["reasons"] = list(quality.get("reasons") or [])
    return out
