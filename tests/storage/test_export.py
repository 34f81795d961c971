"""``chunkscope export``: a seeded store exported as a Chrome trace, CSV and Parquet; the trace
validated against the trace-event format, the tables read back and compared with the queries;
bad input refused with exit status 2 and nothing written."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

from storage import export, queries
from storage.db import connect, migrate
from storage.store import Events, Hello, Store
from testkit.engines import SyntheticEngine

ROOT = Path(__file__).resolve().parents[2]
WALL_NS = 1_790_000_000_000_000_000  # a fixed wall clock: times are reproducible


# ---- a seeded store ---------------------------------------------------------------------------


def _seed(url: str) -> dict[str, SyntheticEngine]:
    """Two engines: ``a`` with a budget cut 512 -> 64 halfway (and a refused change), ``b``
    later and smaller. Returns the synthetic engines (their ``truth`` holds every token time)."""
    db = connect(url)
    migrate(db)
    store = Store(db)
    a = SyntheticEngine(
        engine_id="engine-a", run_id="run-a", seed=1, concurrency=6, wall_ns=WALL_NS
    )
    b = SyntheticEngine(
        engine_id="engine-b",
        run_id="run-b",
        seed=2,
        concurrency=3,
        wall_ns=WALL_NS + 10**9,
        mono_ns=5 * 10**12,
    )
    try:
        for eng, plan in ((a, "cut"), (b, "plain")):
            (info,) = store.apply([Hello(eng.hello())])
            events = eng.steps(30)
            if plan == "cut":
                eng.control("token_budget", 64)
                eng.control("token_budget", 10**6, accepted=False, reason="above the maximum")
            events += eng.steps(30)
            store.apply([Events(info.run_key, events)])
    finally:
        store.close()
        db.dispose()
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, SyntheticEngine]]:
    path = tmp_path_factory.mktemp("export") / "store.db"
    url = f"sqlite:///{path}"
    return url, _seed(url)


@pytest.fixture
def ro(seeded: tuple[str, dict[str, SyntheticEngine]]) -> Any:
    db = connect(seeded[0], readonly=True)
    yield db
    db.dispose()


# ---- the trace-event format -------------------------------------------------------------------


def validate_trace(doc: Any) -> list[dict[str, Any]]:
    """Check a JSON Object Format trace; returns its events."""
    assert isinstance(doc, dict)
    assert doc["displayTimeUnit"] in ("ms", "ns")
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for ev in events:
        for key in ("ph", "ts", "pid", "tid"):
            assert key in ev, (key, ev)
        assert isinstance(ev["ts"], (int, float)) and not isinstance(ev["ts"], bool)
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert ev["ph"] in ("X", "i", "C", "M", "s", "f"), ev
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, ev
            assert ev["ts"] >= 0
        elif ev["ph"] == "C":
            assert isinstance(ev["args"], dict) and ev["args"], ev
            for value in ev["args"].values():
                assert isinstance(value, (int, float)) and not isinstance(value, bool), ev
        elif ev["ph"] == "i":
            assert ev.get("s", "t") in ("g", "p", "t"), ev
        elif ev["ph"] in ("s", "f"):  # a blame arrow: its two ends share cat and id
            assert ev["cat"] == "blame" and isinstance(ev["id"], int), ev
            assert ev["ph"] == "s" or ev["bp"] == "e", ev
        elif ev["ph"] == "M":
            assert ev["name"] in (
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            ), ev
            assert isinstance(ev["args"], dict)
    # Perfetto keys threads by tid alone: a tid belongs to one process
    owner: dict[int, int] = {}
    for ev in events:
        assert owner.setdefault(ev["tid"], ev["pid"]) == ev["pid"], ev
    assert list(doc)[-1] == "traceEvents"  # displayTimeUnit is read only before the events
    _check_nesting(events)
    return events


def _check_nesting(events: list[dict[str, Any]]) -> None:
    """Complete slices on one thread nest properly (a child ends by its parent's end)."""
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            tracks[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    for key, spans in tracks.items():
        stack: list[float] = []
        for t0, t1 in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= t0:
                stack.pop()
            if stack:
                assert t1 <= stack[-1] + 1e-6, f"slice [{t0}, {t1}] crosses its parent on {key}"
            stack.append(t1)


def _by(events: list[dict[str, Any]], ph: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == ph]


# ---- Chrome trace -----------------------------------------------------------------------------


def test_chrome_trace_shows_steps_requests_and_counters(
    seeded: tuple[str, dict[str, SyntheticEngine]], ro: Any, tmp_path: Path
) -> None:
    url, engines = seeded
    out = tmp_path / "trace.json"
    assert export.main(["--db", url, "--format", "chrome-trace", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    events = validate_trace(doc)

    # one process per run, named; a steps thread and one thread per request
    meta = _by(events, "M")
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert sorted(processes.values()) == [
        "engine engine-a / run run-a",
        "engine engine-b / run run-b",
    ]
    pid_of = {name.split()[1]: pid for pid, name in processes.items()}
    steps = queries.steps(ro)
    reqs = queries.requests(ro)
    for engine_id, pid in pid_of.items():
        assert names[(pid, pid)] == "steps"
        threads = {n for (p, t), n in names.items() if p == pid and t != pid}
        mine = reqs[reqs["engine_id"] == engine_id]
        assert threads == {f"req {r.request_id} [{r.traffic_class}]" for r in mine.itertuples()}

    # steps: one complete slice each, with the chunk layout
    step_slices = [e for e in _by(events, "X") if e["name"].startswith("step ")]
    assert all(e["tid"] == e["pid"] for e in step_slices)
    assert len(step_slices) == len(steps)
    a_pid = pid_of["engine-a"]
    a_steps = {e["args"]["step"]: e for e in step_slices if e["pid"] == a_pid}
    chunks = queries.step_chunks(ro, engine_id="engine-a", step_from=0, step_to=10**9)
    for step, group in chunks.groupby("step"):
        layout = a_steps[int(step)]["args"]["chunks"]
        assert [
            (c["request_id"], c["kind"], c["start"], c["num_tokens"], c["produced"]) for c in layout
        ] == [
            (r.request_id, r.kind, r.start, r.num_tokens, bool(r.produced_token))
            for r in group.itertuples()
        ]
    row = steps[(steps["engine_id"] == "engine-a")].iloc[5]
    ev = a_steps[int(row["step"])]
    assert ev["dur"] == pytest.approx((row["end_ns"] - row["start_ns"]) / 1e3, abs=1.0)
    assert ev["args"]["num_prefill_tokens"] == row["num_prefill_tokens"]
    assert ev["args"]["token_budget"] == row["token_budget"]
    # steps follow each other on their track without overlapping
    ordered = sorted(a_steps.values(), key=lambda e: e["ts"])
    for prev, nxt in zip(ordered, ordered[1:], strict=False):
        assert prev["ts"] + prev["dur"] <= nxt["ts"] + 1e-6
    # times are microseconds from the selection's origin: the first step of run a at its offset
    origin = doc["otherData"]["time_origin_unix_s"]
    first = steps[steps["engine_id"] == "engine-a"].iloc[0]
    assert a_steps[int(first["step"])]["ts"] == pytest.approx((first["start"] - origin) * 1e6)

    # each request: a slice from arrival to finish, phases, and its first token marked
    req_slices = [e for e in _by(events, "X") if e["name"].startswith("request ")]
    assert len(req_slices) == len(reqs)
    finished = reqs.dropna(subset=["finished"]).iloc[0]
    sl = next(e for e in req_slices if e["args"]["request_id"] == finished["request_id"])
    assert sl["dur"] == pytest.approx((finished["finished"] - finished["arrival"]) * 1e6, rel=1e-6)
    assert sl["args"]["finished"] is True
    phases = Counter(
        e["name"] for e in _by(events, "X") if e["name"] in ("queued", "prefill", "decode")
    )
    assert phases["prefill"] == reqs["first_scheduled"].notna().sum()
    firsts = [e for e in _by(events, "i") if e["name"] == "first token"]
    assert len(firsts) == reqs["first_token"].notna().sum()
    tok = next(e for e in firsts if e["args"]["request_id"] == finished["request_id"])
    assert tok["ts"] == pytest.approx((finished["first_token"] - origin) * 1e6)
    assert tok["tid"] == sl["tid"]
    # every token is on its request's track (a chunk slice that produced it, with its gap)
    n_tokens = sum(len(t) for eng in engines.values() for t in eng.truth.values())
    produced = [e for e in _by(events, "X") if e.get("args", {}).get("token") is not None]
    assert len(produced) == n_tokens
    itl = queries.token_itl(ro)
    gaps = {(r.request_id, r.k): r.itl_ms for r in itl.itertuples()}
    for e in produced:
        rid = names[(e["pid"], e["tid"])].split()[1]
        if e["args"]["token"] == 1:
            assert "itl_ms" not in e["args"]
        else:
            assert e["args"]["itl_ms"] == pytest.approx(gaps[(rid, e["args"]["token"])])

    # counters: budget, KV, queue, sampled at every step; the budget cut is visible
    counters = _by(events, "C")
    by_name = Counter(e["name"] for e in counters)
    for name in ("tokens", "tokens scheduled", "KV blocks", "requests"):
        assert by_name[name] == len(steps), name
    budgets = [e["args"]["budget"] for e in counters if e["name"] == "tokens" and e["pid"] == a_pid]
    assert budgets[0] == 512 and budgets[-1] == 64
    assert {"running", "waiting"} <= set(
        next(e for e in counters if e["name"] == "requests")["args"]
    )
    # controls: accepted and refused, as instants on the engine's track
    controls = [e for e in _by(events, "i") if e["name"].startswith("token_budget")]
    assert {e["name"] for e in controls} == {
        "token_budget 64 -> 1000000 (refused)",
        "token_budget 512 -> 64",
    }


def test_chrome_trace_gzip_and_filters(
    seeded: tuple[str, dict[str, SyntheticEngine]], ro: Any, tmp_path: Path
) -> None:
    url, _ = seeded
    steps = queries.steps(ro, engine_id="engine-a")
    since, until = float(steps["start"].iloc[10]), float(steps["start"].iloc[20])
    out = tmp_path / "a.json.gz"
    code = export.main(
        [
            "--db",
            url,
            "--engine",
            "engine-a",
            "--since",
            repr(since),
            "--until",
            repr(until),
            "--format",
            "chrome-trace",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    events = validate_trace(json.loads(gzip.decompress(out.read_bytes())))
    assert len({e["pid"] for e in events}) == 1
    step_slices = [e for e in events if e["ph"] == "X" and e["name"].startswith("step ")]
    assert sorted(e["args"]["step"] for e in step_slices) == list(range(10, 21))
    window = queries.requests(ro, engine_id="engine-a", since=since, until=until)
    assert sum(1 for e in events if e["name"].startswith("request ")) == len(window)


# ---- CSV and Parquet --------------------------------------------------------------------------


def _expected_counts(ro: Any, engines: dict[str, SyntheticEngine]) -> dict[str, int]:
    chunks = sum(
        len(queries.step_chunks(ro, engine_id=e.engine_id, step_from=0, step_to=10**9))
        for e in engines.values()
    )
    return {
        "steps": len(queries.steps(ro)),
        "chunks": chunks,
        "requests": len(queries.requests(ro)),
        "tokens": sum(len(t) for e in engines.values() for t in e.truth.values()),
        "controls": len(queries.controls(ro)),
    }


def test_parquet_reads_back_with_pyarrow(
    seeded: tuple[str, dict[str, SyntheticEngine]], ro: Any, tmp_path: Path
) -> None:
    url, engines = seeded
    out = tmp_path / "pq"
    assert export.main(["--db", url, "--format", "parquet", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{t}.parquet" for t in export.TABLES)
    tables = {t: pq.read_table(out / f"{t}.parquet") for t in export.TABLES}
    expected = _expected_counts(ro, engines)
    assert {t: tables[t].num_rows for t in export.TABLES} == expected
    assert tables["steps"].column_names == queries.STEPS_COLUMNS
    assert tables["chunks"].column_names == queries.STEP_CHUNKS_COLUMNS
    assert tables["requests"].column_names == queries.REQUESTS_COLUMNS
    assert tables["tokens"].column_names == export.TOKENS_COLUMNS
    # token times: k = 1 once per request with a first token, the rest equal token_itl
    tokens = tables["tokens"].to_pandas()
    reqs = queries.requests(ro)
    assert (tokens["k"] == 1).sum() == reqs["first_token"].notna().sum()
    itl = queries.token_itl(ro)
    later = tokens[tokens["k"] >= 2].sort_values(["request_id", "k"], ignore_index=True)
    itl = itl.sort_values(["request_id", "k"], ignore_index=True)
    assert later["itl_ms"].tolist() == pytest.approx(itl["itl_ms"].tolist())
    assert later["step"].tolist() == itl["step"].tolist()
    # and the exact times the synthetic engine produced
    a = engines["a"]
    rid = next(iter(a.truth))
    mine = tokens[tokens["request_id"] == rid].sort_values("k")
    assert mine["k"].tolist() == list(range(1, len(a.truth[rid]) + 1))
    assert mine["time"].tolist() == pytest.approx([a.wall(t) for t in a.truth[rid]], abs=1e-6)
    controls = tables["controls"].to_pandas()
    assert sorted(controls["new_value"]) == ["1000000", "64"]


def test_csv_one_file_per_table(
    seeded: tuple[str, dict[str, SyntheticEngine]], ro: Any, tmp_path: Path
) -> None:
    url, engines = seeded
    out = tmp_path / "csv"
    assert export.main(["--db", url, "--format", "csv", "--out", str(out)]) == 0
    frames = {t: pd.read_csv(out / f"{t}.csv") for t in export.TABLES}
    assert {t: len(f) for t, f in frames.items()} == _expected_counts(ro, engines)
    steps = queries.steps(ro)
    assert frames["steps"]["start_ns"].tolist() == steps["start_ns"].tolist()
    assert frames["chunks"]["kind"].isin(["prefill", "decode"]).all()
    # exporting again replaces the files (no temporary leftovers)
    assert export.main(["--db", url, "--format", "csv", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{t}.csv" for t in export.TABLES)


# ---- bad input: exit 2, a clear message, nothing written --------------------------------------


def _exit_code(args: list[str]) -> int:
    """``export.main``'s status, argparse's usage errors (SystemExit) included."""
    try:
        return export.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "svg"], "invalid choice"),
        (["--db", "nonsense"], "not a database URL"),
        (["--db", "mysql://u@h/db"], "unsupported database"),
        (["--db", "sqlite:///{tmp}/missing/none.db"], "no store at"),
        (["--db", "sqlite:///{tmp}/in/text.db"], "cannot read the store"),
        (["--db", "sqlite:///{tmp}/in/empty.db"], "cannot read the store"),
        (["--db", "postgresql+psycopg://nobody@127.0.0.1:1/none"], "cannot read the store"),
        (["--engine", "no-such-engine"], "nothing to export"),
        (["--run", "no-such-run"], "nothing to export"),
        (["--since", "4000000000"], "nothing to export"),
        (["--since", "yesterday"], "not a time"),
        (["--since", "1e12"], "not a time"),
        (["--until", "-5"], "not a time"),
        (["--since", "nan"], "not a time"),
        (["--until", "inf"], "not a time"),
        (["--since", "2000000000", "--until", "1000000000"], "is after"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    seeded: tuple[str, dict[str, SyntheticEngine]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    url, _ = seeded
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "text.db").write_text("not a database\n" * 100)
    (tmp_path / "in" / "empty.db").write_bytes(b"")
    before = sorted(tmp_path.rglob("*"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--db" not in args:
        args = ["--db", url, *args]
    if "--format" not in args:
        args += ["--format", "csv"]
    assert _exit_code([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before


def test_out_of_the_wrong_kind(
    seeded: tuple[str, dict[str, SyntheticEngine]], tmp_path: Path
) -> None:
    url, _ = seeded
    afile = tmp_path / "file.txt"
    afile.write_text("keep")
    with pytest.raises(export.ExportError, match="names a folder"):
        export.export(url, export.Selection(), "parquet", afile)
    with pytest.raises(export.ExportError, match="names a file"):
        export.export(url, export.Selection(), "chrome-trace", tmp_path)
    with pytest.raises(export.ExportError, match="unknown format"):
        export.export(url, export.Selection(), "xml", tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]
    assert afile.read_text() == "keep"


# ---- the command lines ------------------------------------------------------------------------


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=120,
    )


_NO_TORCH = "import sys; from {mod} import main; rc = main(sys.argv[1:]); " + (
    "assert 'torch' not in sys.modules, 'export imported torch'; raise SystemExit(rc)"
)


@pytest.mark.parametrize(
    ("mod", "prefix"), [("chunkscope.cli", ["export"]), ("storage.cli", ["export"])]
)
def test_cli_entry_points_without_torch(
    seeded: tuple[str, dict[str, SyntheticEngine]], tmp_path: Path, mod: str, prefix: list[str]
) -> None:
    """``chunkscope export`` and ``python -m storage export`` (the same main) import no torch."""
    url, _ = seeded
    out = tmp_path / "t.json"
    args = [*prefix, "--db", url, "--format", "chrome-trace", "--out", str(out)]
    proc = _run(_NO_TORCH.format(mod=mod), *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    validate_trace(json.loads(out.read_text()))
    bad = _run(
        _NO_TORCH.format(mod=mod),
        *prefix,
        "--db",
        "nonsense",
        "--format",
        "csv",
        "--out",
        str(tmp_path / "x"),
    )
    assert bad.returncode == 2
    assert "not a database URL" in bad.stderr
    assert not (tmp_path / "x").exists()


# ---- the real engine's events -----------------------------------------------------------------


def test_real_tiny_engine_events_export(tmp_path: Path) -> None:
    """Events of the real ``tiny`` engine, stored through the Store, export to a valid trace
    whose step slices carry the engine's own chunk layouts."""
    pytest.importorskip("torch")
    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model="tiny", device="cpu", token_budget=64, max_token_budget=256))
    received: list[Any] = []
    eng.add_listener(received.append)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((20, 150, 40)):
        eng.add_request(list(range(1, n + 1)), params, request_id=f"r{i}", traffic_class="chat")
    steps = []
    while eng.has_unfinished_requests():
        result = eng.step()
        if result.event is not None:
            steps.append(result.event)
    eng.flush_events()
    anchor = eng.clock_anchor
    hello = {
        "schema": 1,
        "type": "hello",
        "engine_id": eng.engine_id,
        "run_id": "run-tiny",
        "model": "tiny",
        "host": "localhost",
        "pid": os.getpid(),
        "policy": "chunked",
        "token_budget": 64,
        "max_token_budget": 256,
        "kv_blocks_total": eng.block_manager.num_blocks,
        "block_size": 16,
        "config": {},
        "clock": {"wall_ns": anchor.wall_ns, "mono_ns": anchor.mono_ns},
    }
    events = []
    for seq, ev in enumerate(received, start=1):
        d = ev.to_dict()
        d["seq"] = seq
        events.append(d)
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    db = connect(url)
    migrate(db)
    store = Store(db)
    (info,) = store.apply([Hello(hello)])
    store.apply([Events(info.run_key, events)])
    store.close()
    db.dispose()

    out = tmp_path / "tiny.json"
    result = export.export(url, export.Selection(), "chrome-trace", out)
    assert result.counts["steps"] == len(steps)
    assert result.counts["requests"] == 3
    assert result.counts["tokens"] == 3 * 6
    trace = validate_trace(json.loads(out.read_text()))
    slices = {
        e["args"]["step"]: e for e in trace if e["ph"] == "X" and e["name"].startswith("step ")
    }
    for ev in steps:
        layout = slices[ev.step]["args"]["chunks"]
        assert [
            (c["request_id"], c["kind"], c["start"], c["num_tokens"], c["produced"]) for c in layout
        ] == [(c.request_id, c.kind, c.start, c.num_tokens, c.produced_token) for c in ev.chunks]
        assert slices[ev.step]["dur"] == pytest.approx((ev.end_ns - ev.start_ns) / 1e3, abs=1.0)
    assert (
        max(
            e["args"]["num_prefill_tokens"] + e["args"]["num_decode_tokens"]
            for e in slices.values()
        )
        <= 64
    )


# ---- PostgreSQL -------------------------------------------------------------------------------


def test_postgresql_store_exports_the_same_tables(
    pg_server: Any, seeded: tuple[str, dict[str, SyntheticEngine]], tmp_path: Path
) -> None:
    """The same synthetic runs stored in PostgreSQL export the same rows as from SQLite."""
    pg_url = pg_server.create_database()
    _seed(pg_url)
    for name, url in (("sqlite", seeded[0]), ("pg", pg_url)):
        assert export.main(["--db", url, "--format", "parquet", "--out", str(tmp_path / name)]) == 0
    for table in export.TABLES:
        lite = pq.read_table(tmp_path / "sqlite" / f"{table}.parquet").to_pandas()
        pg = pq.read_table(tmp_path / "pg" / f"{table}.parquet").to_pandas()
        assert list(pg.columns) == list(lite.columns), table
        pd.testing.assert_frame_equal(pg, lite, check_dtype=False, obj=table)
    out = tmp_path / "pg.json"
    assert export.main(["--db", pg_url, "--format", "chrome-trace", "--out", str(out)]) == 0
    events = validate_trace(json.loads(out.read_text()))
    assert sum(1 for e in events if e["ph"] == "X" and e["name"].startswith("step ")) == 120


def test_a_non_finite_control_value_in_the_store_exports_as_null(tmp_path: Path) -> None:
    """A control row whose value is ``Infinity`` (not JSON; the collector refuses such numbers
    at its edge, but a store may already hold one): every export format still works, and the
    value reads as null."""
    url = f"sqlite:///{tmp_path / 'inf.db'}"
    db = connect(url)
    migrate(db)
    store = Store(db)
    eng = SyntheticEngine(engine_id="e", run_id="r", seed=1, concurrency=2, wall_ns=WALL_NS)
    (info,) = store.apply([Hello(eng.hello())])
    events = eng.steps(3)
    eng.control("token_budget", 64, accepted=False, reason="refused")
    events += eng.steps(2)
    store.apply([Events(info.run_key, events)])
    store.close()
    with db.begin() as c:
        c.exec_driver_sql("UPDATE controls SET new_value = 'Infinity', old_value = '-Infinity'")
    db.dispose()
    out = tmp_path / "t.json"
    assert export.main(["--db", url, "--format", "chrome-trace", "--out", str(out)]) == 0
    json.loads(out.read_text())
    assert export.main(["--db", url, "--format", "csv", "--out", str(tmp_path / "csv")]) == 0
    controls = pd.read_csv(tmp_path / "csv" / "controls.csv")
    assert len(controls) == 1 and controls["new_value"].isna().all()
    assert "Infinity" not in (tmp_path / "csv" / "controls.csv").read_text()
