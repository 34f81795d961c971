"""The one rule for a control value: every receiver refuses with the very same reason."""

from __future__ import annotations

import pytest

from dashboard import control as dashboard_control
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from wire.control import CONTROL_KEYS, POLICIES, ControlRefused, check_changes, refusal

BAD = [
    ("token_budget", 0, "token_budget must be from 1 to 64, got 0"),
    ("token_budget", 65, "token_budget must be from 1 to 64, got 65"),
    ("token_budget", True, "token_budget must be an integer, got True"),
    ("token_budget", "8", "token_budget must be an integer, got '8'"),
    ("policy", "fifo", "policy must be one of chunked, unchunked, got 'fifo'"),
]


@pytest.mark.parametrize(("key", "value", "reason"), BAD)
def test_refusal_reads_the_same_at_every_receiver(key: str, value: object, reason: str) -> None:
    assert refusal(key, value, max_token_budget=64) == reason
    with pytest.raises(ControlRefused) as info:
        check_changes({key: value}, 64)
    assert info.value.reason == reason and info.value.param == key
    scheduler = Scheduler(BlockManager(16, 4), max_token_budget=64, token_budget=8)
    setter = scheduler.set_token_budget if key == "token_budget" else scheduler.set_policy
    result = setter(value)
    assert not result.accepted and result.reason == reason
    assert (scheduler.token_budget, scheduler.policy) == (8, "chunked")


def test_dashboard_uses_the_rule_under_its_label() -> None:
    with pytest.raises(ValueError, match="^token budget must be from 1 to 64, got 65$"):
        dashboard_control.validate_budget("65", 64)
    with pytest.raises(ValueError, match="^policy must be one of chunked, unchunked, got 'x'$"):
        dashboard_control.validate_policy("x")


def test_valid_changes_pass_in_key_order() -> None:
    assert refusal("token_budget", 64, max_token_budget=64) is None
    assert refusal("token_budget", 10**9, max_token_budget=None) is None
    assert refusal("policy", POLICIES[1], max_token_budget=None) is None
    assert check_changes({"policy": "unchunked", "token_budget": 2}, 64) == {
        "token_budget": 2,
        "policy": "unchunked",
    }
    assert list(check_changes(dict.fromkeys(CONTROL_KEYS, 1) | {"policy": "chunked"}, 1)) == list(
        CONTROL_KEYS
    )


@pytest.mark.parametrize("changes", [{}, [], None, {"temperature": 1}])
def test_bad_shapes_and_keys_are_refused(changes: object) -> None:
    with pytest.raises(ControlRefused):
        check_changes(changes, 64)


def test_engine_policies_only_when_the_engine_says_so() -> None:
    assert refusal("policy", "fifo", max_token_budget=None, policies=("fifo",)) is None
    assert refusal("token_budget", 0, max_token_budget=None) == (
        "token_budget must be from 1 or more, got 0"
    )


def test_secrets_compare_as_bytes_and_never_raise() -> None:
    from wire.control import same_secret

    assert same_secret("s3cret", "s3cret") and same_secret("été", "été")
    assert not same_secret("été", "ete") and not same_secret("ete", "été")
    assert not same_secret(None, "x") and not same_secret(["x"], "x")


def test_a_control_mac_binds_engine_run_id_and_changes() -> None:
    from wire.control import control_mac

    base = {"control_id": "c1", "engine_id": "e", "run_id": "r", "changes": {"token_budget": 8}}
    mac = control_mac("tok", **base)  # type: ignore[arg-type]
    assert len(mac) == 64 and "tok" not in mac
    for change in ({"control_id": "c2"}, {"engine_id": "f"}, {"run_id": "s"},
                   {"changes": {"token_budget": 9}}):  # fmt: skip
        assert control_mac("tok", **{**base, **change}) != mac  # type: ignore[arg-type]
    assert control_mac("other", **base) != mac  # type: ignore[arg-type]
    reordered = {"policy": "chunked", "token_budget": 8}
    assert control_mac("tok", **{**base, "changes": reordered}) == control_mac(  # type: ignore[arg-type]
        "tok",
        **{**base, "changes": dict(reversed(list(reordered.items())))},  # type: ignore[arg-type]
    )


def test_relay_declaration_names_who_asks_and_why() -> None:
    from wire.control import MAX_REASON_CHARS, relay_declaration

    assert relay_declaration({"type": "control"}) == ("collector", None)
    assert relay_declaration({"source": "autopilot", "reason": "why"}) == ("autopilot", "why")
    for bad in ({"source": "api"}, {"source": 3}, {"reason": 5}, {"reason": "x" * 501}):
        with pytest.raises(ControlRefused) as exc:
            relay_declaration(bad)
        assert exc.value.param in ("source", "reason")
    assert MAX_REASON_CHARS == 500
