"""The story in a real browser, for every long-prompt profile, as a newcomer follows the README:
one freshly started main job with its defaults (embedded ``demo`` engine at budget 4096), each
profile started from the sidebar with its defaults, the Live page watched until the first long
prompt or image lands, the budget cut to 256 (128 for ``vlm``) on the Control page, Live watched
again, then the Compare page as it opens (``benchmarks.story`` drives it).

The verdict is read over the windows the Compare page chooses by itself, not picked by the test:
every long prompt or image before the cut began its prefill while chat streams were in flight,
the worst chat gap after the cut is at least 2x shorter than before (the benchmark holds five runs
in a row to 3x), and the Compare page's first line says the stalls got shorter, and by how
much. The Live page's charts are all drawn.

``CHUNKSCOPE_SCREENSHOT_DIR=DIR`` copies the screenshots there; ``CHUNKSCOPE_STORY_JSON=PATH``
appends each profile's result (JSON lines).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.story import CHROMIUM_ARGS, Story
from tests.dashboard.server import StreamlitServer, alive, descendants
from tests.dashboard.test_browser import _chromium_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.serial]

# The benchmark (benchmarks/story.py, five runs of each profile in a row) holds the story to 3x.
# Here one run per profile guards the mechanism on whatever the CI machine is doing: the browser
# shares the engine's two cores and once slowed one 256-token chunk step to 370 ms (a 2.9x run);
# a budget that did not bound the steps would give about 1x.
MIN_RATIO = 2.0


@dataclass
class Session:
    server: StreamlitServer
    story: Story
    shots: Path
    kids: set[int]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    chromium = _chromium_or_skip()
    from playwright.sync_api import expect, sync_playwright

    from storage import db as storage_db

    expect.set_options(timeout=120_000)
    tmp = tmp_path_factory.mktemp("story")
    server = StreamlitServer(tmp).start()  # the main job's defaults: nothing set
    kids: set[int] = set()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(120_000)
            page.goto(server.url)
            expect(page.get_by_role("heading", name="Live")).to_be_visible()
            server.wait_for_children()
            assert server.proc is not None
            kids = descendants(server.proc.pid)
            db = storage_db.connect(f"sqlite:///{server.data_dir / 'chunkscope.db'}", readonly=True)
            yield Session(server, Story(page, db, tmp), tmp, kids)
            browser.close()
    finally:
        server.stop(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.1)
    assert not [p for p in kids if alive(p)], "processes left after the dashboard stopped"


def _charts_drawn(page: Any) -> list[str]:
    """The titles of the Live page's charts, each read from a drawn chart (a chart that has not
    drawn has no title text)."""
    return [(t or "").strip() for t in page.locator(".js-plotly-plot .gtitle").all_text_contents()]


@pytest.mark.parametrize("profile", ["rag", "vlm", "mixed"])
def test_story_with_the_defaults(session: Session, profile: str) -> None:
    result = session.story.run(profile)
    out = os.environ.get("CHUNKSCOPE_SCREENSHOT_DIR")
    if out:
        for shot in result.screenshots:
            shutil.copyfile(shot, Path(out) / Path(shot).name)
    if os.environ.get("CHUNKSCOPE_STORY_JSON"):
        with open(os.environ["CHUNKSCOPE_STORY_JSON"], "a") as f:
            f.write(json.dumps(result.as_dict()) + "\n")
    summary = {
        "before": {k: result.before[k] for k in ("long_requests", "in_flight", "gap_max_ms")},
        "after": {k: result.after[k] for k in ("long_requests", "in_flight", "gap_max_ms")},
        "ratio": result.chat_gap_ratio,
        "lead": result.compare_lead,
        "load": result.load_average_1m,
    }
    # every long prompt or image before the cut met chat streams in flight
    assert result.all_long_met, summary
    assert result.before["long_met"] == result.before["long_requests"] >= 1, summary
    # the worst chat gap, over the windows Compare chose, shorter after the cut by MIN_RATIO
    assert result.chat_gap_ratio is not None and result.chat_gap_ratio >= MIN_RATIO, summary
    # and Compare says so first
    assert result.compare_lead.startswith("Stalls ") and "x shorter:" in result.compare_lead, (
        summary
    )
    # the Live page under traffic draws every chart (checked on its last screenshot's page)
    session.story.go("Live")
    deadline = time.time() + 30
    want = {"Tokens per step", "KV cache and queue"}
    while not want <= set(_charts_drawn(session.story.page)):
        assert time.time() < deadline, _charts_drawn(session.story.page)
        time.sleep(0.5)
    assert any(t.startswith("Inter-token latency") for t in _charts_drawn(session.story.page))


def test_sidebar_clicks_take_effect_while_live_redraws_under_load(session: Session) -> None:
    """On the Live page, with traffic running: every click in the sidebar takes effect (each
    is checked by what the sidebar shows next). How long each took is recorded, not judged."""
    from playwright.sync_api import expect

    story = session.story
    page, sb = story.page, story.sidebar
    story.go("Live")
    story.start_traffic("mixed")
    time.sleep(10.0)  # the page redraws every two seconds; the engine is busy
    took = []
    typed_last: dict[str, str] = {}
    try:
        for i in range(8):
            profile = ("rag", "vlm")[i % 2]
            t = time.monotonic()
            sb.get_by_test_id("stSelectbox").filter(has_text="Profile").click()
            page.get_by_role("option", name=profile, exact=True).click()
            # the profile's preset drawn (the answer to that click), then a value typed in
            expect(sb.get_by_role("spinbutton", name="Rate (req/s)")).to_have_value(
                f"{story_rate(profile):.2f}", timeout=30_000
            )
            users = sb.get_by_role("spinbutton", name="Chat users")
            # the profile's preset users drawn too on its first visit, and on later visits the
            # value last typed into it (typed values below never equal either)
            shown = typed_last.get(profile, str(story_users(profile)))
            expect(users).to_have_value(shown, timeout=30_000)
            typed = str(story_users(profile) + 10 + i)
            typed_last[profile] = typed
            users.fill(typed)
            users.press("Enter")
            # kept through the next redraws of the sidebar and the page
            time.sleep(2.5)  # a sidebar redraw (every 2 s) and a page redraw in between
            expect(users).to_have_value(typed, timeout=30_000)
            took.append(round(time.monotonic() - t - 2.5, 2))
        t = time.monotonic()
        story.stop_traffic()
        took.append(round(time.monotonic() - t, 2))
    finally:
        if story.traffic_running():
            story.stop_traffic()
    if os.environ.get("CHUNKSCOPE_STORY_JSON"):
        with open(os.environ["CHUNKSCOPE_STORY_JSON"], "a") as f:
            f.write(json.dumps({"sidebar_clicks_s": took}) + "\n")
    assert len(took) == 9


def story_rate(profile: str) -> float:
    from dashboard.services import PROFILES

    return PROFILES[profile].rate


def story_users(profile: str) -> int:
    from dashboard.services import PROFILES

    return PROFILES[profile].users
