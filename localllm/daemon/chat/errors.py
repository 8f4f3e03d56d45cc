"""The chat layer's one error: what a request asks of a model that it cannot do.

Its own module so that request.py and the parts it calls (images.py) can both raise it, and
ContextOverflow, the 400 for a prompt longer than the loaded context."""

from __future__ import annotations

from localllm.errors import UserError


class ChatError(UserError):
    """The request asks for something this model cannot do (status 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextOverflow(ChatError):
    """A prompt longer than the loaded context (status 400). Agents compact and retry only on
    an error their classifier reads as an overflow, so each API family words it the way its
    own servers do (daemon/http_errors.py: `overflow_message`), with this message, which says
    what to do, after it. `tokens` is the prompt's size (a lower bound where only its bytes
    were measured), `n_ctx` the context's."""

    code = "context_length_exceeded"  # OpenAI's code for it

    def __init__(self, message: str, tokens: int, n_ctx: int, param: str | None = "messages"):
        super().__init__(message, param)
        self.tokens = tokens
        self.n_ctx = n_ctx
