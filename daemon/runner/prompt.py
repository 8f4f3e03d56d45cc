"""A request's prompt as tokens: a raw prompt as given, or messages through the chat template."""

from __future__ import annotations

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .model import Tokenizer
from .protocol import GenerationRequest
from .sampling import RequestError


class Prompter:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.metadata("tokenizer.chat_template")
        self.formatter = None
        if template:
            self.formatter = Jinja2ChatFormatter(template=template,
                                                 eos_token=tokenizer.eos_piece,
                                                 bos_token=tokenizer.bos_piece)

    def tokens(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            return self._templated(list(request.messages))
        prompt = request.prompt or ""
        if not request.raw and self.formatter is not None:
            messages = [{"role": "system", "content": request.system}] if request.system else []
            return self._templated(messages + [{"role": "user", "content": prompt}])
        if request.system and not request.raw:
            prompt = f"{request.system}\n\n{prompt}"
        return self.tokenizer.tokenize(prompt)

    def _templated(self, messages: list[dict]) -> list[int]:
        if self.formatter is None:
            raise RequestError("this model has no chat template; use /api/generate or "
                               "/v1/completions with a plain prompt")
        try:
            rendered = self.formatter(messages=messages)
        except Exception as e:
            raise RequestError(f"the chat template rejected these messages: {e}") from None
        return self.tokenizer.tokenize(rendered.prompt)
