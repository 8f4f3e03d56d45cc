"""Which exceptions are the user's to fix, and the one line that tells them how."""

from __future__ import annotations


def user_message(error: BaseException) -> str | None:
    """The message to print for an error a user can act on, or None for a real bug."""
    from localllm.config import ConfigError
    from localllm.modelstore.gguf_header import GGUFError
    from localllm.modelstore.names import BadModelName
    from localllm.modelstore.store import StoreError
    from localllm.modelstore.wheel_source import WheelSourceError

    known: tuple[type[BaseException], ...] = (
        ConfigError, GGUFError, BadModelName, StoreError, WheelSourceError, UserError,
    )
    if isinstance(error, known):
        return str(error)
    if isinstance(error, (ConnectionError, TimeoutError)):
        return f"{error}"
    return None


class UserError(Exception):
    """Raised by any module for a problem the user can fix; the message says what to do."""
