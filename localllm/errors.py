"""The one base of every error a user can fix: its message says what to do, and its `status` is
what the API answers with. The CLI prints the message on one line and exits 1; the daemon's
error middleware answers with the status in the route's own error shape. Anything else that
escapes is a bug (a 500 with a logged traceback)."""

from __future__ import annotations


class UserError(Exception):
    """Raised by any module for a problem the user can fix; the message says what to do."""

    status = 400  # classes and instances may say otherwise (404, 409, 503...)


def user_message(error: BaseException) -> str | None:
    """The message to print for an error a user can act on, or None for a real bug."""
    if isinstance(error, (UserError, ConnectionError, TimeoutError)):
        return str(error)
    return None
