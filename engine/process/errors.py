"""The engine process's errors as the HTTP server answers them: OpenAI-style error JSON.

The engine-core client and its streams refuse and fail requests with :class:`APIError` (the server
maps it to a response unchanged), so the error type lives below both. No torch, no pydantic.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error to send back as OpenAI-style JSON with HTTP status ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
