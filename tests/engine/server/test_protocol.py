"""Request parsing and OpenAI-style errors (no engine needed)."""

from __future__ import annotations

import json

import pytest

from engine.process.errors import APIError, error_body
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImagePart,
    SchedulerUpdate,
    check_traffic_class,
    parse_request,
)


def _parse(model: type, body: object) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(model, raw)


def _error(model: type, body: object) -> APIError:
    with pytest.raises(APIError) as info:
        _parse(model, body)
    assert info.value.status == 400
    return info.value


def test_completion_defaults_and_fields() -> None:
    req = _parse(
        CompletionRequest,
        {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": 5,
            "temperature": 0,
            "stop": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
            "unknown_extra": 1,
        },
    )
    assert isinstance(req, CompletionRequest)
    assert req.prompt_text_or_ids == "hello"
    assert req.include_usage and req.stop_list == ["x"]
    kw = req.sampling_kwargs(5)
    assert kw["temperature"] == 0.0 and kw["max_tokens"] == 5


def test_token_id_prompt_and_single_string_list() -> None:
    assert _parse(CompletionRequest, {"prompt": [1, 2, 3]}).prompt_text_or_ids == [1, 2, 3]
    assert _parse(CompletionRequest, {"prompt": ["a"]}).prompt_text_or_ids == "a"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "", "max_tokens": 1}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (
            {"prompt": "x", "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
    ],
)
def test_completion_errors_name_the_field(body: dict, param: str) -> None:
    err = _error(CompletionRequest, body)
    assert err.param is not None and err.param.startswith(param), err.to_dict()
    assert err.message


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"\xff\xfe", b"null"])
def test_malformed_json(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, raw)
    assert info.value.status == 400
    body = info.value.to_dict()
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_chat_parts_and_errors() -> None:
    req = _parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    ],
                },
            ],
            "max_completion_tokens": 7,
        },
    )
    assert isinstance(req, ChatCompletionRequest)
    assert req.requested_max_tokens == 7 and req.num_images == 1
    assert isinstance(req.messages[1].parts()[1], ImagePart)
    assert _error(ChatCompletionRequest, {"messages": []}).param == "messages"
    bad_role = {"messages": [{"role": "bot", "content": "x"}]}
    assert _error(ChatCompletionRequest, bad_role).param == "messages[0].role"
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert _error(ChatCompletionRequest, bad_part).param == "messages[0].content[0].image_url.url"


def test_scheduler_update_forbids_unknown_keys() -> None:
    assert _parse(SchedulerUpdate, {"token_budget": 64}).token_budget == 64
    assert _error(SchedulerUpdate, {"budget": 64}).param == "budget"
    assert _error(SchedulerUpdate, {"token_budget": "64"}).param == "token_budget"


def test_traffic_class_and_error_body() -> None:
    assert check_traffic_class(" RAG ") == "rag"
    assert check_traffic_class(None) is None
    with pytest.raises(APIError):
        check_traffic_class("has space")
    assert error_body("m", code="c") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": None, "code": "c"}
    }


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": 5e-324}, "temperature"),
        ({"temperature": 0.005}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_sampling_bounds_name_the_field(model: type, extra: dict, param: str) -> None:
    base = (
        {"prompt": "x"}
        if model is CompletionRequest
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    err = _error(model, {**base, **extra})
    assert err.param is not None and err.param.startswith(param), err.to_dict()
    assert err.to_dict()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0},
        {"temperature": 0.01},
        {"temperature": 2},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"stop_token_ids": list(range(64))},
    ],
)
def test_sampling_bounds_accept_the_edges(extra: dict) -> None:
    req = _parse(CompletionRequest, {"prompt": "x", **extra})
    assert isinstance(req, CompletionRequest)
