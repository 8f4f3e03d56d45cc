"""The model's load, free and tokenizer live in llama/model.py (the engine room); this name
stays for the callers that import them from the runner (the tests among them)."""

from localllm.llama.model import (  # noqa: F401
    LlamaModel,
    ModelLoadError,
    Tokenizer,
    batch_capacity,
    free,
    load,
)
