"""A real browser (Playwright driving Debian's Chromium) on the embedded default: live charts
appear, the budget is changed through the UI, the engine's acknowledgement and the change marker
show, a screenshot is saved; then no process is left behind.

Chromium comes from Debian (``apt-get install chromium``, done by ``.ci/run``); never
``playwright install``. Without it the test skips, saying why, unless
``CHUNKSCOPE_REQUIRE_CHROMIUM=1`` makes that a failure. ``CHUNKSCOPE_SCREENSHOT=PATH`` also
writes the screenshot there (``docs/img/dashboard.png`` was made that way);
``CHUNKSCOPE_BROWSER_MODEL`` picks the engine preset (default ``tiny``, for speed);
``CHUNKSCOPE_SCREENSHOT_BEFORE_S`` / ``_WAIT_S`` let traffic run longer before the budget change
and before the screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.dashboard.server import StreamlitServer, alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.serial]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
NEW_BUDGET = 256


def _chromium_or_skip() -> str:
    reason = None
    if not Path(CHROMIUM).exists():
        reason = f"{CHROMIUM} not found (install Debian's chromium: apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError as exc:
            reason = f"the playwright package is missing: {exc}"
    if reason is not None:
        if os.environ.get("CHUNKSCOPE_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"CHUNKSCOPE_REQUIRE_CHROMIUM=1 but {reason}")
        pytest.skip(reason)
    return CHROMIUM


def test_browser_live_charts_budget_change_and_screenshot(tmp_path: Path) -> None:
    chromium = _chromium_or_skip()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=120_000)

    model = os.environ.get("CHUNKSCOPE_BROWSER_MODEL", "tiny")
    server = StreamlitServer(
        tmp_path, env={"CHUNKSCOPE_MODEL": model, "CHUNKSCOPE_TOKEN_BUDGET": "4096"}
    ).start()
    kids: set[int] = set()
    shot = tmp_path / "dashboard.png"
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

            # traffic from the sidebar launcher
            sidebar = page.get_by_test_id("stSidebar")
            start = sidebar.get_by_role("button", name="Start traffic")
            expect(start).to_be_enabled()
            start.click()
            expect(sidebar.get_by_text(re.compile(r"Load: running"))).to_be_visible()

            # live charts: the status line appears once steps are stored, the ITL chart fills
            expect(page.get_by_text(re.compile(r"newest step .* ago")).first).to_be_visible()
            # a fragment redraw can hold old and new charts side by side for a moment: >= 4
            expect(page.locator(".js-plotly-plot").nth(3)).to_be_attached()
            expect(
                page.get_by_text(re.compile(r"Inter-token latency — \d+ stalls")).first
            ).to_be_visible()
            expect(page.locator(".js-plotly-plot .scatterlayer .js-fill").first).to_be_attached()
            time.sleep(float(os.environ.get("CHUNKSCOPE_SCREENSHOT_BEFORE_S", "0")))

            # the budget, changed through the UI
            page.get_by_role("link", name="Control").click()
            expect(page.get_by_role("heading", name="Control")).to_be_visible()
            box = page.get_by_role("spinbutton", name="Token budget", exact=True)
            box.fill(str(NEW_BUDGET))
            box.press("Enter")
            page.get_by_role("button", name="Apply budget").click()
            ack = page.get_by_text(re.compile(r"applied at step \d+ \(token_budget 4096 → 256\)"))
            expect(ack).to_be_visible()

            # a refused value never reaches the engine: the UI says why
            box.fill("0")
            box.press("Enter")
            page.get_by_role("button", name="Apply budget").click()
            expect(
                page.get_by_text(re.compile(r"Not sent: token budget must be from 1"))
            ).to_be_visible()

            # back on Live: the change is a marker on the time axes
            page.get_by_role("link", name="Live").click()
            marker = page.locator(".js-plotly-plot").get_by_text(
                re.compile(rf"budget 4096 → {NEW_BUDGET} @ step \d+")
            )
            expect(marker.first).to_be_visible()
            time.sleep(float(os.environ.get("CHUNKSCOPE_SCREENSHOT_WAIT_S", "3")))
            # the charts redraw every second: shoot when all four are drawn, not mid-redraw
            drawn = (
                "() => { const p = Array.from(document.querySelectorAll('.js-plotly-plot'));"
                " return p.length === 4 && p[0].querySelectorAll('.js-fill').length > 0"
                " && p.every(e => e.getBoundingClientRect().height > 0); }"
            )
            for _ in range(80):
                if page.evaluate(drawn):
                    break
                time.sleep(0.05)
            page.screenshot(path=str(shot), full_page=True)
            sidebar.get_by_role("button", name="Stop traffic").click()
            browser.close()
    finally:
        server.stop(signal.SIGTERM)
    assert shot.stat().st_size > 10_000
    if os.environ.get("CHUNKSCOPE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["CHUNKSCOPE_SCREENSHOT"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.1)
    assert not [p for p in kids if alive(p)], "processes left after the dashboard stopped"
