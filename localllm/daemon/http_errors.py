"""The errors an HTTP answer is made of: `ApiError`, which a handler raises, and the error shape
of each API family, chosen by the route's path: Anthropic's for /v1/messages, OpenAI's for the
rest of /v1/, Ollama's `{"error": ...}` elsewhere.

Handlers raise ApiError (or a known domain error); the error middleware (server.py) and the
security middleware (security.py) answer through `error_body`. No handler formats an error
itself. This module stands below the routes, so that every middleware can use it.
"""

from __future__ import annotations

from localllm.errors import UserError


class ApiError(UserError):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code  # OpenAI's error code, where one fits better than the status's


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for a busy server; the queue's 503 becomes this there


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The API's error shape; `code` is OpenAI's (`model_not_found` only for a missing
    model, not for a route that does not exist)."""
    if is_anthropic(path):
        return {"type": "error", "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    if path.startswith("/v1/"):  # OpenAI's error shape
        kind = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 503: "server_overloaded"}.get(status, "server_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"error": message}


def overflow_message(path: str, tokens: int, n_ctx: int, message: str) -> str:
    """A prompt longer than the context, worded as the clients of the route's API family
    recognize an overflow (they compact the conversation and retry on it): Anthropic's "prompt
    is too long: N tokens > M maximum" (Claude Code reads the two numbers), OpenAI's "maximum
    context length is M tokens" (with the code `context_length_exceeded`), each followed by
    `message`, which says what to do. Ollama's routes keep `message` alone."""
    if is_anthropic(path):
        return f"prompt is too long: {tokens} tokens > {n_ctx} maximum. {_sentence(message)}"
    if path.startswith("/v1/"):
        return (f"This model's maximum context length is {n_ctx} tokens. However, your "
                f"messages resulted in {tokens} tokens. Please reduce the length of the "
                f"messages. {_sentence(message)}")
    return message


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]
