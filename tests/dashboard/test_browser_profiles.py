"""The story in five steps, in a real browser, for every long-prompt profile: ``rag``, ``vlm`` and
``mixed`` started from the sidebar of one freshly started main job (embedded ``demo`` engine at
budget 4096), the budget cut to 256 (128 for ``vlm``) on the Control page, and the store read
back: the chat streams' worst inter-token gap after the cut is at least 3x shorter than before.

Each window holds at least one long request (a RAG prompt or an image) prefilled while chat
streams were decoding (before the cut, an image or a prompt of at least 2,000 tokens), so both
sides measure a chat stream meeting a long prompt; the windows close as soon as they do
(bounded), which keeps the three profiles to a few minutes. A window
after the cut that falls short is followed by one more (both recorded in the result).
Between profiles the budget goes back to 4096 through the same Control page.

``CHUNKSCOPE_SCREENSHOT_DIR=DIR`` copies the Live and Compare screenshots there
(``docs/img/story_*.png`` were made that way); ``CHUNKSCOPE_STORY_JSON=PATH`` appends each
profile's measured windows (JSON lines). Chromium as in ``test_browser.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dashboard.services import PROFILES
from tests.dashboard.server import StreamlitServer, alive, descendants
from tests.dashboard.test_browser import CHROMIUM_ARGS, _chromium_or_skip

pytestmark = pytest.mark.slow

START_BUDGET = 4096
# The README's step 4: 256; for images 128, since an image chunk also runs its part of the
# vision encoder (a 256-token image step measured 260-420 ms beside 1.2 s whole-image steps)
CUT_BUDGET = {"rag": 256, "vlm": 128, "mixed": 256}
MIN_RATIO = 3.0
MIN_WINDOW_S = 8.0  # each window lasts at least this long
# and at most this long waiting for a long prompt among chat streams (with the AVX-512 kernels a
# chat stream ends sooner, so a long prompt finds one streaming less often; the bound is generous)
MAX_WINDOW_S = 150.0
RUN_S = 3 * MAX_WINDOW_S + 60.0  # the traffic's duration: outlasts the three windows
# the window before the cut waits for a long prompt of at least this many prompt tokens (or
# an image): RAG documents are 1,500-4,000 tokens, and on the AVX-512 engine a 1,500-token
# document prefilled at once (~0.3 s) is only ~3x the last 256-token chunk of a 4,000-token
# one (~0.1 s): a short document before the cut and a long one after it measure no budget at
# all (CI at 46ebe4d, rag: both windows after the cut short). From 2,000 tokens the one-shot
# step is ~0.45 s, ~4.5x that chunk whatever the document after the cut
MIN_PROMPT_BEFORE = 2000


@dataclass
class Story:
    server: StreamlitServer
    page: Any
    db_url: str
    shots: Path
    kids: set[int]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    chromium = _chromium_or_skip()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=120_000)
    tmp = tmp_path_factory.mktemp("story")
    server = StreamlitServer(
        tmp, env={"CHUNKSCOPE_MODEL": "demo", "CHUNKSCOPE_TOKEN_BUDGET": str(START_BUDGET)}
    ).start()
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
            db_url = f"sqlite:///{server.data_dir / 'chunkscope.db'}"
            yield Story(server, page, db_url, tmp, kids)
            browser.close()
    finally:
        server.stop(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.1)
    assert not [p for p in kids if alive(p)], "processes left after the dashboard stopped"


def _db(url: str) -> Any:
    from storage import db

    return db.connect(url)


def _engine_url(server: StreamlitServer) -> str:
    m = re.search(r"chunkscope engine listening on (http://\S+)", server.child_log("engine"))
    assert m, server.child_log("engine")[-2000:]
    return m.group(1)


def _budget(server: StreamlitServer) -> int:
    with urllib.request.urlopen(f"{_engine_url(server)}/v1/scheduler", timeout=10) as r:
        return int(json.loads(r.read())["token_budget"])


def _chat_gaps(db: Any, lo: float, hi: float) -> pd.DataFrame:
    """Chat inter-token gaps lying wholly in [lo, hi] (a gap that spans the cut is in neither)."""
    from storage import queries

    itl = queries.token_itl(db, since=lo - 30, until=hi, traffic_class="chat")
    if itl.empty:
        return itl
    begin = itl["time"] - itl["itl_ms"] / 1000.0
    return itl[(begin >= lo) & (itl["time"] <= hi)]


def _met(db: Any, lo: float, hi: float, min_prompt: int = 0) -> bool:
    """A long request (not chat) began its prefill in [lo, hi] while a chat stream waited for
    its next token, and that chat gap lies wholly in [lo, hi] and is in the store: a long prompt
    met by a chat stream, measured in the window. Judged from the token gaps themselves (judged
    from the requests table alone, a window once held no chat gap at all: ratio NaN).
    ``min_prompt``: only a request with an image or at least this many prompt tokens counts."""
    from storage import queries

    reqs = queries.requests(db, since=lo)
    if reqs.empty:
        return False
    long = reqs[
        (reqs["traffic_class"] != "chat")
        & (reqs["first_scheduled"] >= lo)
        & (reqs["first_token"] <= hi)
        & ((reqs["num_prompt_tokens"] >= min_prompt) | (reqs["num_image_tokens"] > 0))
    ]
    gaps = _chat_gaps(db, lo, hi)
    if long.empty or gaps.empty:
        return False
    begin = gaps["time"] - gaps["itl_ms"] / 1000.0
    for r in long.itertuples():
        # the gap holding the long prompt's first chunk: begun before that step, ended after it
        if ((begin <= r.first_scheduled + 1e-3) & (gaps["time"] > r.first_scheduled)).any():
            return True
    return False


def _wait_window(db: Any, lo: float, min_prompt: int = 0) -> float:
    """Until a long request (``min_prompt`` as :func:`_met`) was prefilled among chat streams
    after ``lo`` (and at least ``MIN_WINDOW_S`` passed): the window's end."""
    deadline = time.time() + MAX_WINDOW_S
    while True:
        now = time.time()
        if now - lo >= MIN_WINDOW_S and _met(db, lo, now, min_prompt):
            return now
        assert now < deadline, f"no long request among chat streams within {MAX_WINDOW_S} s"
        time.sleep(1.0)


def _pick(page: Any, container: Any, label: str, option: str) -> None:
    box = container.get_by_test_id("stSelectbox").filter(has_text=label)
    box.click()
    page.get_by_role("option", name=option, exact=True).click()


def _go(page: Any, name: str, expect: Any) -> None:
    page.get_by_role("link", name=name).click()
    expect(page.get_by_role("heading", name=name)).to_be_visible()


def _set_budget(page: Any, value: int, expect: Any) -> str:
    _go(page, "Control", expect)
    box = page.get_by_role("spinbutton", name="Token budget", exact=True)
    box.fill(str(value))
    box.press("Enter")
    page.get_by_role("button", name="Apply budget").click()
    ack = page.get_by_text(re.compile(rf"applied at step \d+ \(token_budget \d+ → {value}\)"))
    expect(ack).to_be_visible()
    # the same page agrees with the answer: the value in force, and the change in History
    metric = page.get_by_test_id("stMetric").filter(has_text="Token budget")
    expect(metric.get_by_test_id("stMetricValue")).to_have_text(str(value))
    step = re.search(r"applied at step (\d+)", ack.inner_text())
    assert step
    return step.group(1)


def _stop_traffic(sidebar: Any, expect: Any) -> None:
    """Stop the run; a click can land while the sidebar fragment redraws it: try again."""
    stopped = sidebar.get_by_text(re.compile(r"Load: stopped"))
    for attempt in range(3):
        stop = sidebar.get_by_role("button", name="Stop traffic")
        if stop.is_enabled():
            stop.click()
        try:
            expect(stopped).to_be_visible(timeout=20_000)
            return
        except AssertionError:
            if attempt == 2:
                raise


def _shoot(page: Any, path: Path) -> None:
    time.sleep(2.0)
    # shoot between redraws: Streamlit greys out the elements a rerun has not redrawn yet
    for _ in range(100):
        if page.evaluate("() => !document.querySelector('[data-stale=\"true\"]')"):
            break
        time.sleep(0.05)
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    out = os.environ.get("CHUNKSCOPE_SCREENSHOT_DIR")
    if out:
        shutil.copyfile(path, Path(out) / path.name)


@pytest.mark.parametrize("profile", ["rag", "vlm", "mixed"])
def test_story_in_five_steps(story: Story, profile: str) -> None:
    from playwright.sync_api import expect

    from storage import queries

    page, server = story.page, story.server
    db = _db(story.db_url)
    if _budget(server) != START_BUDGET:
        _set_budget(page, START_BUDGET, expect)
    _go(page, "Live", expect)

    # step 2: the profile from the sidebar; rag and vlm bring their chat background
    sidebar = page.get_by_test_id("stSidebar")
    _pick(page, sidebar, "Profile", profile)
    rate = sidebar.get_by_role("spinbutton", name="Rate (req/s)")
    expect(rate).to_have_value(f"{PROFILES[profile].rate:.2f}")  # the rerun has drawn it
    if profile != "mixed":
        bg = sidebar.get_by_role("spinbutton", name="Chat background (req/s)")
        expect(bg).to_have_value(re.compile(r"^[1-9]"))  # the preset's 1 req/s
    # a run long enough for both windows (the test stops it): the default 120 s once ended 50 s
    # after the cut, and none of the four images sent after it had met a chat stream
    duration = sidebar.get_by_role("spinbutton", name="Duration (s)")
    duration.fill(f"{RUN_S:.2f}")
    duration.press("Enter")
    expect(duration).to_have_value(f"{RUN_S:.2f}")
    start = sidebar.get_by_role("button", name="Start traffic")
    expect(start).to_be_enabled()
    t_start = time.time()
    start.click()
    running = rf"Load: running: {profile} at .* for {RUN_S:g} s"
    expect(sidebar.get_by_text(re.compile(running))).to_be_visible()

    # step 3: a long prompt among chat streams at the large budget. The browser waits on the
    # Control page: the Live page redraws three charts a second, CPU the engine needs more
    _go(page, "Control", expect)
    _wait_window(db, t_start, MIN_PROMPT_BEFORE)

    # step 4: the cut, through the Control page
    step = _set_budget(page, CUT_BUDGET[profile], expect)
    ctrl = queries.controls(db)
    row = ctrl[(ctrl["applied_at_step"] == int(step)) & (ctrl["new_value"] == CUT_BUDGET[profile])]
    assert not row.empty, ctrl
    # the applied step's start reaches the store with that step's event, which comes after the
    # step ends (a long step, or a busy machine, can take seconds): wait for it, bounded
    deadline = time.time() + 30.0
    while not row["applied_at"].notna().any():
        assert time.time() < deadline, f"step {step}'s start never reached the store: {ctrl}"
        time.sleep(0.5)
        ctrl = queries.controls(db)
        ours = (ctrl["applied_at_step"] == int(step)) & (ctrl["new_value"] == CUT_BUDGET[profile])
        row = ctrl[ours]
    cut = float(row["applied_at"].dropna().iloc[0])
    # the Live page marks the cut (checked now: it draws the last minute only, and the window
    # after the cut can outlast it; once the marker had scrolled off before it was looked for)
    _go(page, "Live", expect)
    marker = page.locator(".js-plotly-plot").get_by_text(
        re.compile(rf"budget {START_BUDGET} → {CUT_BUDGET[profile]} @ step {step}")
    )
    expect(marker.first).to_be_visible()
    _go(page, "Control", expect)

    # step 5: a long prompt among chat streams after the cut, then the store's verdict. When the
    # window after falls short, one more window after it is measured (both are recorded): one
    # slow step of the machine (once 388 ms beside its 111 ms twin) must not decide the story,
    # while a budget that does not bound the steps fails both windows
    # (measured from the return to the Control page: the Live page's redraws take CPU)
    # (``lo`` stays the start of the window last measured: advanced past it after the last
    # try, the result below measured an empty window, and two failed windows read "ratio nan")
    start = max(cut, time.time())
    t_end, tries = start, []
    for _ in range(2):
        lo = start
        t_end = _wait_window(db, lo)
        worst_before = float(_chat_gaps(db, t_start, cut)["itl_ms"].max())
        worst_after = float(_chat_gaps(db, lo, t_end)["itl_ms"].max())
        tries.append({"from_s": round(lo - cut, 1), "to_s": round(t_end - cut, 1),
                      "chat_itl_max_ms": round(worst_after, 1)})  # fmt: skip
        if worst_before >= MIN_RATIO * worst_after:
            break
        start = t_end
    # the sidebar says what the engine served against what the launcher offers
    served = sidebar.get_by_text(re.compile(r"Engine finished [\d.]+ req/s over the last \d+ s"))
    expect(served).to_be_visible()
    # stopped from the Control page, whose sidebar is the only part redrawing: on the Live page
    # a loaded 2-core machine once left the click without effect for a minute (CI, three tries)
    _stop_traffic(sidebar, expect)
    _go(page, "Live", expect)
    _shoot(page, story.shots / f"story_{profile}_live.png")

    before = _chat_gaps(db, t_start, cut)
    after = _chat_gaps(db, lo, t_end)
    result = {
        "profile": profile,
        "budget_before": START_BUDGET,
        "budget_after": CUT_BUDGET[profile],
        "before_s": round(cut - t_start, 1),
        "after_s": round(t_end - lo, 1),
        "after_windows": tries,
        "chat_itl_max_ms_before": round(float(before["itl_ms"].max()), 1),
        "chat_itl_max_ms_after": round(float(after["itl_ms"].max()), 1),
        "chat_itl_p99_ms_before": round(float(before["itl_ms"].quantile(0.99)), 1),
        "chat_itl_p99_ms_after": round(float(after["itl_ms"].quantile(0.99)), 1),
        "chat_tokens_before": len(before),
        "chat_tokens_after": len(after),
    }
    result["ratio"] = round(result["chat_itl_max_ms_before"] / result["chat_itl_max_ms_after"], 2)
    # a diagnosis, not a criterion: a decode-only step lasting ~1 s means the CPUs were taken
    # (the engine thread was descheduled), not that the budget failed
    steps = queries.steps(db, since=lo, until=t_end)
    decode_only = steps[steps["num_prefill_tokens"] == 0]["duration_ms"]
    result["decode_only_step_max_ms_after"] = round(float(decode_only.max()), 1)
    # and one step far slower than the median step of the same window, for the same work, is a
    # hiccup of the machine or the process (once: 388 ms beside its 111 ms twin)
    result["step_max_ms_after"] = round(float(steps["duration_ms"].max()), 1)
    result["step_p50_ms_after"] = round(float(steps["duration_ms"].median()), 1)
    result["load_average_1m"] = os.getloadavg()[0]
    if os.environ.get("CHUNKSCOPE_STORY_JSON"):
        with open(os.environ["CHUNKSCOPE_STORY_JSON"], "a") as f:
            f.write(json.dumps(result) + "\n")

    # the Compare page: the change, chat by default, marked better or worse
    _go(page, "Compare", expect)
    cls = page.get_by_role("combobox", name="Traffic class")
    expect(cls).to_match_aria_snapshot('- combobox "Traffic class": chat')
    expect(page.get_by_test_id("stDataFrame").first).to_be_visible()
    expect(page.locator(".js-plotly-plot").first).to_be_visible()
    _shoot(page, story.shots / f"story_{profile}_compare.png")

    assert result["ratio"] >= MIN_RATIO, result
