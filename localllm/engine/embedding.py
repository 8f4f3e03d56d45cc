"""Embeddings from an already loaded model, in a llama.cpp context of their own.

The generating context keeps its KV cache (and its prefix reuse) untouched: embeddings get a
second context on the same `llama_model`, made with `embeddings=True` and the GGUF's pooling
type, or mean pooling for a causal LM whose GGUF names none. Vectors come back unit length.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import llama_cpp

from .batch import fill

# The embedding context's size: enough for the chunks editors index (Continue sends at most a
# few hundred tokens each), small enough to cost little memory beside the generating context.
MAX_EMBED_CTX = 8192


class EmbedInputError(Exception):
    """An input does not fit and the request said not to truncate (status 400)."""


class Embedder:
    def __init__(self, model: llama_cpp.llama_model_p, n_ctx: int, n_threads: int,
                 n_threads_batch: int, pooling_type: int | None):
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        n_train = llama_cpp.llama_model_n_ctx_train(model)
        self.n_ctx = max(64, min(n_ctx, MAX_EMBED_CTX, n_train or MAX_EMBED_CTX))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_ctx  # non-causal models read each input in one batch
        params.n_ubatch = self.n_ctx
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch
        params.embeddings = True
        if pooling_type in (None, llama_cpp.LLAMA_POOLING_TYPE_NONE,
                            llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED):
            pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN  # a causal LM: mean of its states
        if pooling_type == llama_cpp.LLAMA_POOLING_TYPE_RANK:
            raise ValueError("this model is a reranker; it scores pairs and makes no embeddings")
        params.pooling_type = pooling_type
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the embedding context (out of memory?)")
        self.n_embd = llama_cpp.llama_model_n_embd(model)
        self.encoder = llama_cpp.llama_model_has_encoder(model)
        self.batch = llama_cpp.llama_batch_init(self.n_ctx, 0, 1)

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        size = len(data) + 8
        buf = (llama_cpp.llama_token * size)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, size, True, False)
        if n < 0:
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, -n, True, False)
        return list(buf[:n])

    def embed(self, inputs: Sequence[str], truncate: bool = True,
              dimensions: int | None = None) -> tuple[list[tuple[float, ...]], int]:
        """A unit vector per input (its first `dimensions` only, if given) and the tokens read
        over all inputs. An input longer than the context is cut, or with `truncate` False
        refused (EmbedInputError)."""
        vectors, total = [], 0
        for i, text in enumerate(inputs):
            tokens = self.tokenize(text)
            if len(tokens) > self.n_ctx:
                if not truncate:
                    raise EmbedInputError(
                        f"input {i} is {len(tokens)} tokens, more than the embedding context "
                        f"of {self.n_ctx}; the input length exceeds the context length (send "
                        f"truncate: true to cut it)")
                tokens = tokens[: self.n_ctx]
            total += len(tokens)
            vectors.append(self._pool(tokens, dimensions))
        return vectors, total

    def _pool(self, tokens: list[int], dimensions: int | None) -> tuple[float, ...]:
        if not tokens:
            return tuple(0.0 for _ in range(dimensions or self.n_embd))
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        batch = self.batch
        fill(batch, tokens, all_logits=True)
        run = llama_cpp.llama_encode if self.encoder else llama_cpp.llama_decode
        rc = run(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama.cpp failed to embed the input (code {rc})")
        pointer = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not pointer:
            raise RuntimeError("llama.cpp returned no pooled embedding")
        values = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float))[: self.n_embd]
        if dimensions:
            values = values[:dimensions]
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        return tuple(v / norm for v in values)
