"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, as the exception every
refusal raises; torch-free, so that `k3 route` answers in the same shape without loading torch."""
from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
