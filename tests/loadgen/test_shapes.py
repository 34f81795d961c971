"""Named shape sets, the chat background in the plan, and the offered-vs-served check."""

from __future__ import annotations

import pytest

from loadgen.saturation import load
from loadgen.shapes import background_rate, background_users, resolve, shaped_profiles
from loadgen.workload import ChatUsers, PlanOptions, build_plan


def test_auto_picks_demo_shapes_for_the_demo_presets_only() -> None:
    assert resolve("auto", "demo") == "demo" and resolve("auto", "tiny") == "demo"
    assert resolve("auto", "meta-llama/Llama-3.2-1B") == "realistic"
    assert resolve("auto", None) == "realistic" and resolve("realistic", "demo") == "realistic"
    with pytest.raises(ValueError, match="shapes must be one of"):
        resolve("huge", "demo")


def test_chat_users_default_under_rag_vlm_and_mixed() -> None:
    p = shaped_profiles("demo")
    assert p.chat.background_users >= 3  # several streams for every long prompt to stall
    for profile in ("rag", "vlm", "mixed"):
        assert background_users(profile, None, p, trace=False) == p.chat.background_users
    assert background_users("chat", None, p, trace=False) == 0
    assert background_users("rag", None, p, trace=True) == 0
    assert background_users("rag", 0, p, trace=False) == 0
    assert background_users("chat", 2, p, trace=False) == 2
    assert shaped_profiles("realistic").chat.background_users == 0
    with pytest.raises(ValueError, match="background_users must be in"):
        shaped_profiles("demo", ["chat.background_users=-1"])
    with pytest.raises(ValueError, match="think_s must be in"):
        shaped_profiles("demo", ["chat.think_s=-0.5"])


def test_chat_users_turns_are_seeded_and_never_share_a_user_prompt() -> None:
    p = shaped_profiles("demo").chat
    users = ChatUsers(p, 3, seed=7, max_model_len=4096)

    def first(user: int, n: int) -> list[tuple[float, int, int, str]]:
        out = []
        for (pause, spec), _ in zip(users.turns(user), range(n), strict=False):
            own = [seg.key for seg in spec.segments if not seg.shared]
            out.append((pause, spec.max_tokens, spec.prompt_len, own[0]))
        return out

    a = first(0, 20)
    assert a == first(0, 20)  # same seed, same turns
    assert a != first(1, 20)
    names = [x[3] for u in range(3) for x in first(u, 20)]
    assert len(names) == len(set(names))  # only the system prompt is shared
    assert a[0][0] == 0.0  # every user starts at once
    pauses = [x[0] for x in a[1:]]
    assert 0.3 * p.think_s < sum(pauses) / len(pauses) < 3 * p.think_s
    with pytest.raises(ValueError, match="chat users must be >= 0"):
        ChatUsers(p, -1)


def test_background_defaults_under_rag_and_vlm_only() -> None:
    p = shaped_profiles("demo", ["chat.background_rate=1"])
    assert background_rate("rag", None, p, trace=False) == p.chat.background_rate == 1.0
    assert background_rate("vlm", None, p, trace=False) == 1.0
    assert background_rate("mixed", None, p, trace=False) == 0.0
    assert background_rate("chat", None, p, trace=False) == 0.0
    assert background_rate("rag", None, p, trace=True) == 0.0
    assert background_rate("rag", 0.0, p, trace=False) == 0.0
    assert background_rate("mixed", 2.0, p, trace=False) == 2.0


def test_plan_adds_a_chat_population_with_its_own_prompts() -> None:
    p = shaped_profiles("demo")
    opts = PlanOptions(profile="rag", rate=0.5, duration=60.0, seed=1, background_chat=2.0)
    plan = build_plan(p, opts)
    chat = [s for s in plan if s.traffic_class == "chat"]
    rag = [s for s in plan if s.traffic_class == "rag"]
    assert 80 <= len(chat) <= 160 and 10 <= len(rag) <= 50  # Poisson around 120 and 30
    assert all(s.meta.get("background") for s in chat)
    assert [s.index for s in plan] == list(range(len(plan)))
    own = {seg.key for s in chat for seg in s.segments if not seg.shared}
    assert len(own) == len(chat) and all(n.startswith("chat-bg/") for n in own)
    # the profile's own requests do not move when the background is added
    alone = build_plan(p, PlanOptions(profile="rag", rate=0.5, duration=60.0, seed=1))
    assert [s.offset_s for s in alone] == [s.offset_s for s in rag]
    # in mixed the background's prompts never collide with mixed's own chat prompts
    mixed = build_plan(
        p, PlanOptions(profile="mixed", rate=2.0, duration=30.0, seed=1, background_chat=1.0)
    )
    names = [seg.key for s in mixed for seg in s.segments if not seg.shared]
    assert len(names) == len(set(names))


def test_background_rate_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="background_rate must be >= 0"):
        shaped_profiles("demo", ["chat.background_rate=-1"])


def test_offered_vs_served() -> None:
    assert load([1.0, 2.0], [], 10.0) is None  # too young to tell
    keeps_up = load([float(t) for t in range(60)], [t + 0.5 for t in range(59)], 60.0)
    assert keeps_up is not None and not keeps_up.overloaded
    behind = load([t / 2 for t in range(120)], [float(t) for t in range(20)], 60.0)
    assert behind is not None and behind.overloaded
    assert behind.offered_rps == pytest.approx(2.0) and behind.served_rps == pytest.approx(1 / 3)
    assert "cannot keep up" in behind.describe()
    # only the last minute counts: an old backlog that has cleared is no overload
    old = load([float(t) for t in range(10)], [60.0 + t for t in range(10)], 130.0)
    assert old is not None and not old.overloaded
