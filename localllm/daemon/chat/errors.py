"""The chat layer's one error: what a request asks of a model that it cannot do.

Its own module so that request.py and the parts it calls (images.py) can both raise it."""

from __future__ import annotations

from localllm.errors import UserError


class ChatError(UserError):
    """The request asks for something this model cannot do (status 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
