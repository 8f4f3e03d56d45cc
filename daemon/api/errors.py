"""The error shape of each API family, chosen by the route's path: Anthropic's for
/v1/messages, OpenAI's for the rest of /v1/, Ollama's `{"error": ...}` elsewhere. The error
middleware (server.py) and the security middleware (security.py) both answer through it."""

from __future__ import annotations

from . import anthropic


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The API's error shape; `code` is OpenAI's (`model_not_found` only for a missing
    model, not for a route that does not exist)."""
    if is_anthropic(path):
        return anthropic.error_json(status, message)
    if path.startswith("/v1/"):  # OpenAI's error shape
        kind = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 503: "server_overloaded"}.get(status, "server_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"error": message}
