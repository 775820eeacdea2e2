"""OpenAI-style error bodies and the exception handlers raise to send one."""

from __future__ import annotations

import orjson


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> bytes:
    """Serialize `{"error": {"message", "type", "param", "code"}}` as OpenAI clients expect it."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


class HttpError(Exception):
    """Raised by a handler to answer with `status` and an OpenAI error body instead of a result."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"HttpError status must be an int in 400..599, got {status!r}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = list(headers) if headers else []

    def body(self) -> bytes:
        """The JSON error body for this error."""
        return error_body(self.message, self.type, self.param, self.code)
