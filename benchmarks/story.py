"""The dashboard's story, driven in a real browser the way a newcomer follows the README, with
the sidebar's defaults and nothing picked: for one traffic profile, start it from the sidebar,
watch the Live page until the first long prompt or image lands, cut the budget on the Control
page, watch Live again, read the Compare page as it opens. The verdict is read from the store
over the windows the Compare page chooses by itself (``dashboard.story.change_windows``).

The browser test (``tests/dashboard/test_browser_profiles.py``) runs it once per profile; as a
command it runs it several times in a row against a dashboard already running, the way the
README starts it, and writes every run (passed or not) to a JSON file with its configuration::

    bash scripts/run.sh &        # the dashboard at http://127.0.0.1:8501, store in ./data
    .venv/bin/python -m benchmarks.story --runs 5       # writes benchmarks/results/story.json

Playwright drives Debian's Chromium; the store is read on a read-only connection.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dashboard.services import PROFILES
from dashboard.story import change_windows
from storage import queries
from storage.stalls import StallWindow, long_mask, stall_window

logger = logging.getLogger(__name__)

START_BUDGET = 4096
# The README's cut: 256; for images 128 (an image chunk also runs its part of the vision encoder)
CUT_BUDGET = {"rag": 256, "vlm": 128, "mixed": 256}
WATCH_BEFORE_S = 30.0  # a newcomer watches Live at least this long before the cut...
WAIT_FIRST_LONG_S = 150.0  # ...and until the first long prompt or image has landed, at most
WATCH_AFTER_S = 40.0  # and this long after it
MIN_RATIO = 3.0
# the Compare page's first line: its verdict on the stalls, or what it waits for
LEAD = re.compile(r"^(Stalls |The \d+ s before the change|No long prompt)")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


@dataclass
class StoryResult:
    """One run of the story: the Compare page's default windows, what they held, what the page
    said. Times are wall seconds; figures in ms."""

    profile: str
    budget_before: int
    budget_after: int
    cut: float
    started: float
    ended: float
    before: dict[str, Any]
    after: dict[str, Any]
    compare_lead: str
    restarts: int = 0  # traffic restarted after the cut (the default run ended first)
    load_average_1m: float = 0.0
    screenshots: list[str] = field(default_factory=list)

    @property
    def chat_gap_ratio(self) -> float | None:
        """The worst chat gap before the cut over the worst after it."""
        a, b = self.before.get("gap_max_ms"), self.after.get("gap_max_ms")
        return None if not a or not b else float(a) / float(b)

    @property
    def all_long_met(self) -> bool:
        """Every long prompt or image of the window before the cut began its prefill while chat
        streams were in flight."""
        flights = self.before.get("in_flight") or []
        return bool(flights) and min(flights) >= 1

    @property
    def ok(self) -> bool:
        r = self.chat_gap_ratio
        lead = self.compare_lead
        return (
            self.all_long_met
            and r is not None
            and r >= MIN_RATIO
            and lead.startswith("Stalls ")
            and "x shorter" in lead.split(":")[0]
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(chat_gap_ratio=self.chat_gap_ratio, all_long_met=self.all_long_met, ok=self.ok)
        return out


class Story:
    """A browser page on a dashboard started with its embedded engine (``bash scripts/run.sh``),
    and that dashboard's store (``db_url``)."""

    def __init__(self, page: Any, db: Any, shots: Path | None = None) -> None:
        self.page = page
        self.db = db
        self.shots = shots
        self.sidebar = page.get_by_test_id("stSidebar")

    # ---- the page, as a user moves through it ------------------------------------------------

    def go(self, name: str) -> None:
        from playwright.sync_api import expect

        self.page.get_by_role("link", name=name).click()
        expect(self.page.get_by_role("heading", name=name)).to_be_visible()

    def budget_shown(self) -> int:
        """The budget in force, as the Control page shows it."""
        from playwright.sync_api import expect

        self.go("Control")
        metric = self.page.get_by_test_id("stMetric").filter(has_text="Token budget")
        value = metric.get_by_test_id("stMetricValue")
        expect(value).to_have_text(re.compile(r"^\d+$"))
        return int(value.inner_text())

    def set_budget(self, value: int) -> int:
        """Control page: type the budget, Apply; the step it applied at (from the page)."""
        from playwright.sync_api import expect

        page = self.page
        self.go("Control")
        box = page.get_by_role("spinbutton", name="Token budget", exact=True)
        box.fill(str(value))
        box.press("Enter")
        page.get_by_role("button", name="Apply budget").click()
        ack = page.get_by_text(re.compile(rf"applied at step \d+ \(token_budget \d+ → {value}\)"))
        expect(ack).to_be_visible()
        metric = page.get_by_test_id("stMetric").filter(has_text="Token budget")
        expect(metric.get_by_test_id("stMetricValue")).to_have_text(str(value))
        step = re.search(r"applied at step (\d+)", ack.inner_text())
        assert step, ack.inner_text()
        return int(step.group(1))

    def start_traffic(self, profile: str) -> float:
        """Sidebar: the profile, its defaults as they are, Start traffic. The time of the click."""
        from playwright.sync_api import expect

        page, sb = self.page, self.sidebar
        box = sb.get_by_test_id("stSelectbox").filter(has_text="Profile")
        box.click()
        page.get_by_role("option", name=profile, exact=True).click()
        rate = sb.get_by_role("spinbutton", name="Rate (req/s)")
        expect(rate).to_have_value(f"{PROFILES[profile].rate:.2f}")  # the preset, drawn
        users = sb.get_by_role("spinbutton", name="Chat users")
        expect(users).to_have_value(str(PROFILES[profile].users))
        start = sb.get_by_role("button", name="Start traffic")
        expect(start).to_be_enabled()
        t = time.time()
        start.click()
        expect(sb.get_by_text(re.compile(rf"Load: running: {profile} at "))).to_be_visible()
        return t

    def traffic_running(self) -> bool:
        return self.sidebar.get_by_text(re.compile(r"Load: running")).count() > 0

    def stop_traffic(self) -> None:
        from playwright.sync_api import expect

        stop = self.sidebar.get_by_role("button", name="Stop traffic")
        if stop.is_enabled():
            stop.click()
        expect(self.sidebar.get_by_text(re.compile(r"Load: (stopped|done)"))).to_be_visible(
            timeout=30_000
        )

    def shoot(self, name: str) -> str | None:
        """A screenshot between redraws (Streamlit greys what a rerun has not redrawn yet)."""
        if self.shots is None:
            return None
        time.sleep(1.0)
        for _ in range(100):
            if self.page.evaluate("() => !document.querySelector('[data-stale=\"true\"]')"):
                break
            time.sleep(0.05)
        path = self.shots / name
        self.page.screenshot(path=str(path))
        return str(path)

    def compare_lead(self) -> str:
        """The Compare page as it opens on the newest change: its first lines."""
        from playwright.sync_api import expect

        self.go("Compare")
        main = self.page.get_by_test_id("stMain")
        expect(main.get_by_test_id("stDataFrame").first).to_be_visible()
        lead = main.locator("p").filter(has_text=LEAD)
        expect(lead.first).to_be_visible()
        return str(lead.first.inner_text()).strip()

    # ---- the store ---------------------------------------------------------------------------

    def run_ids(self) -> tuple[str, str]:
        engines = queries.engines(self.db)
        row = engines.iloc[0]  # newest first: the embedded engine's run
        return str(row["engine_id"]), str(row["run_id"])

    def long_prefills_since(self, t: float) -> int:
        """Long prompts or images whose prefill began after ``t`` (what a newcomer sees as a
        tall step on the Live page)."""
        reqs = queries.requests(self.db, since=t)
        if reqs.empty:
            return 0
        long = reqs[long_mask(reqs)]
        return int((long["first_scheduled"] >= t).sum())

    def cut_time(self, step: int, value: int, timeout: float = 60.0) -> float:
        """When the change took effect: the start of the step it applied at (stored with that
        step's event, after the step ends)."""
        deadline = time.time() + timeout
        while True:
            ctrl = queries.controls(self.db)
            row = ctrl[(ctrl["applied_at_step"] == step) & (ctrl["new_value"] == value)]
            if not row.empty and row["applied_at"].notna().any():
                return float(row["applied_at"].dropna().iloc[0])
            assert time.time() < deadline, f"step {step}'s start never reached the store"
            time.sleep(0.5)

    def windows(self, cut: float) -> tuple[StallWindow, StallWindow]:
        """The Compare page's default windows either side of the change at ``cut``, read."""
        engine_id, run_id = self.run_ids()
        ctrl = queries.controls(self.db, engine_id=engine_id, run_id=run_id)
        from dashboard.charts import control_marker_times

        marks = control_marker_times(ctrl)
        marks = marks[marks["accepted"]]
        runs = queries.engines(self.db)
        run = runs[(runs["engine_id"] == engine_id) & (runs["run_id"] == run_id)].iloc[0]
        win = change_windows(
            cut,
            [float(x) for x in marks["x"] if abs(float(x) - cut) > 1e-6],
            first=float(run["started"]),
            latest=float(run["last_time"]),
        )
        assert win.after is not None, "no steps after the change"
        return tuple(  # type: ignore[return-value]
            stall_window(self.db, engine_id=engine_id, run_id=run_id, since=lo, until=hi)
            for lo, hi in (win.before, win.after)
        )

    # ---- the whole story -----------------------------------------------------------------------

    def run(self, profile: str, tag: str = "") -> StoryResult:
        """One pass of the story for ``profile``, from the budget back at 4096."""
        if self.budget_shown() != START_BUDGET:
            self.set_budget(START_BUDGET)
        self.go("Live")
        started = self.start_traffic(profile)
        # watch Live until the first long prompt or image has landed (and a little longer)
        deadline = started + WAIT_FIRST_LONG_S
        while time.time() < started + WATCH_BEFORE_S or not self.long_prefills_since(started):
            assert time.time() < deadline, f"{profile}: no long prompt within {WAIT_FIRST_LONG_S} s"
            time.sleep(1.0)
        shots = [self.shoot(f"story_{profile}{tag}_live_before.png")]
        cut_to = CUT_BUDGET[profile]
        step = self.set_budget(cut_to)
        cut = self.cut_time(step, cut_to)
        self.go("Live")
        restarts = 0
        while time.time() < cut + WATCH_AFTER_S:
            if not self.traffic_running() and restarts < 2:
                # the default run (120 s) ended: a newcomer starts it again
                self.start_traffic(profile)
                restarts += 1
            time.sleep(1.0)
        shots.append(self.shoot(f"story_{profile}{tag}_live_after.png"))
        lead = self.compare_lead()
        shots.append(self.shoot(f"story_{profile}{tag}_compare.png"))
        before, after = self.windows(cut)
        if self.traffic_running():
            self.stop_traffic()
        return StoryResult(
            profile=profile,
            budget_before=START_BUDGET,
            budget_after=cut_to,
            cut=cut,
            started=started,
            ended=time.time(),
            before=before.as_dict(),
            after=after.as_dict(),
            compare_lead=lead,
            restarts=restarts,
            load_average_1m=os.getloadavg()[0],
            screenshots=[s for s in shots if s],
        )


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from benchmarks._common import add_common_args, config_of, setup, write_json

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.story",
        description="The README's story in a real browser, several runs of each profile in a "
        "row, with the sidebar's defaults; every run written, passed or not.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8501", help="the running dashboard")
    p.add_argument("--db", default="sqlite:///data/chunkscope.db", help="its store")
    p.add_argument("--profiles", default="rag,vlm,mixed")
    p.add_argument("--runs", type=int, default=5, help="runs of each profile, in a row")
    p.add_argument("--shots", default=None, help="folder for the screenshots (default: none)")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.quick:  # one run of the first profile
        args.runs, args.profiles = 1, args.profiles.split(",")[0]
    out = setup(args) / "story.json"
    from playwright.sync_api import expect, sync_playwright

    from storage import db as storage_db

    profiles = [x.strip() for x in args.profiles.split(",") if x.strip()]
    bad = [x for x in profiles if x not in CUT_BUDGET]
    if bad or args.runs < 1:
        p.error(f"profiles must be among {', '.join(CUT_BUDGET)} and --runs >= 1")
    shots = Path(args.shots) if args.shots else None
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    expect.set_options(timeout=120_000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(120_000)
        page.goto(args.url)
        expect(page.get_by_role("heading", name="Live")).to_be_visible()
        # the main job starts its collector and engine with the first session
        engine = page.get_by_test_id("stSidebar").get_by_text(re.compile(r"Engine: http"))
        expect(engine).to_be_visible(timeout=300_000)
        story = Story(page, storage_db.connect(args.db, readonly=True), shots)
        for profile in profiles:  # each profile's runs in a row
            for i in range(args.runs):
                try:
                    res = story.run(profile, tag=f"_{i + 1}").as_dict()
                except Exception as exc:  # noqa: BLE001 - a failed run is a result too
                    res = {"profile": profile, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                res["run"] = i + 1
                results.append(res)
                print(json.dumps({k: res.get(k) for k in ("profile", "run", "ok",
                      "chat_gap_ratio", "compare_lead", "error")}), flush=True)  # fmt: skip
                write_json(
                    out,
                    {"runs": results},
                    script="story.py",
                    config={**config_of(args), "watch_before_s": WATCH_BEFORE_S,
                            "watch_after_s": WATCH_AFTER_S, "cut_budget": CUT_BUDGET,
                            "start_budget": START_BUDGET},
                )  # fmt: skip
        browser.close()
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
