"""``storage.fleet_summary``: one row per engine (its newest run), the collector from the
fleet's table while that collector is alive, the last minute's figures, worst first."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
from sqlalchemy import insert

from storage import db as dbm
from storage import schema
from storage.fleet_summary import fleet_summary
from storage.stalls import stall_window
from storage.store import Events, Hello, Store
from testkit.seed import SynthRun


def test_every_engine_once_worst_first_with_its_collector(tmp_path: Path) -> None:
    db = dbm.connect(f"sqlite:///{tmp_path / 's.db'}")
    dbm.migrate(db)
    store = Store(db)
    calm = SynthRun(engine_id="calm", run_id="calm-1", change_at_step=0)  # budget 128 all along
    stalling = SynthRun(engine_id="stalling", run_id="stalling-1", change_at_step=None)
    old = SynthRun(engine_id="stalling", run_id="stalling-0", change_at_step=None)
    old.wall_ns -= 10**12  # an older run of the same engine id
    for run in (old, calm, stalling):
        [info] = store.apply([Hello(run.hello())])
        store.apply([Events(info.run_key, run.events())])
    now = time.time()
    with db.begin() as conn:
        conn.execute(
            insert(schema.fleet_collectors).values(
                collector_id="c1", url="ws://a:8765", started=now, heartbeat=now
            )
        )
        conn.execute(
            insert(schema.fleet_engines).values(
                engine_id="calm",
                run_id="calm-1",
                collector_id="c1",
                connected=True,
                info=json.dumps({"engine_id": "calm"}),
                updated=now,
            )
        )
    table = fleet_summary(db)
    assert list(table["engine_id"]) == ["stalling", "calm"]  # one row per engine, worst first
    rows = table.set_index("engine_id")
    assert rows.loc["stalling", "run_id"] == "stalling-1"  # the newest run
    assert rows.loc["calm", "collector"] == "ws://a:8765" and rows.loc["calm", "connected"]
    assert pd.isna(rows.loc["stalling", "collector"])
    # the figures are the stall window's over the run's last minute
    until = float(rows.loc["stalling", "last_time"])
    want = stall_window(
        db, engine_id="stalling", run_id="stalling-1", since=until - 60, until=until + 1e-3
    )
    assert rows.loc["stalling", "stalls"] == want.stalls > 0
    assert rows.loc["stalling", "worst_chat_itl_ms"] == want.gap_max_ms
    assert rows.loc["stalling", "worst_chat_itl_ms"] > rows.loc["calm", "worst_chat_itl_ms"]
    assert rows.loc["stalling", "steps_per_s"] > 0
    store.close()
    db.dispose()
