"""Embeddings from an already loaded model, in a llama.cpp context of their own.

The generating context keeps its KV cache (and its prefix reuse) untouched: embeddings get a
second context on the same `llama_model`, made with `embeddings=True` and the GGUF's pooling
type. A causal LM whose GGUF names none is mean-pooled here, its input read in micro-batches of
the plan's size: a context whose batch was its whole length (8192 tokens) grew a runner by 1.2
GiB of compute buffers on one long input, memory no plan had counted. Vectors come back unit
length.

A reranker (a GGUF with rank pooling: a cross-encoder, or a causal model with a rank head) makes
no embeddings; it scores a query and a document read together, in the pair llama.cpp's server
builds (`format_prompt_rerank`: the GGUF's `rerank` template, else BOS query EOS SEP document
EOS as the vocabulary adds them), one score per document (the head's first output).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import llama_cpp
import numpy

from .batch import fill

# The embedding context's size: enough for the chunks editors index (Continue sends at most a
# few hundred tokens each), small enough to cost little memory beside the generating context.
MAX_EMBED_CTX = 8192


class EmbedInputError(Exception):
    """An input does not fit and the request said not to truncate (status 400)."""


class Embedder:
    def __init__(self, model: llama_cpp.llama_model_p, n_ctx: int, n_threads: int,
                 n_threads_batch: int, pooling_type: int | None, n_ubatch: int = 512):
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        n_train = llama_cpp.llama_model_n_ctx_train(model)
        self.n_ctx = max(64, min(n_ctx, MAX_EMBED_CTX, n_train or MAX_EMBED_CTX))
        self.ranks = pooling_type == llama_cpp.LLAMA_POOLING_TYPE_RANK
        # A causal LM (no pooling in its GGUF): each token's state, summed here a micro-batch at
        # a time, so the batch is the plan's, not the context's length. An embedding model
        # pools inside llama.cpp, which needs the whole input in one micro-batch (and such
        # models are small).
        self.mean_here = pooling_type in (None, llama_cpp.LLAMA_POOLING_TYPE_NONE,
                                          llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
        self.chunk = max(1, min(n_ubatch, self.n_ctx)) if self.mean_here else self.n_ctx
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = self.chunk
        params.n_ubatch = self.chunk
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE if self.mean_here \
            else pooling_type
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the embedding context (out of memory?)")
        self.n_embd = llama_cpp.llama_model_n_embd(model)
        self.encoder = llama_cpp.llama_model_has_encoder(model)
        self.batch = llama_cpp.llama_batch_init(self.chunk, 0, 1)

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def tokenize(self, text: str, add_special: bool = True, special: bool = False) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        size = len(data) + 8
        buf = (llama_cpp.llama_token * size)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, size, add_special,
                                     special)
        if n < 0:
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special,
                                         special)
        return list(buf[:n])

    def embed(self, inputs: Sequence[str], truncate: bool = True,
              dimensions: int | None = None) -> tuple[list[tuple[float, ...]], int]:
        """A unit vector per input (its first `dimensions` only, if given) and the tokens read
        over all inputs. An input longer than the context is cut, or with `truncate` False
        refused (EmbedInputError)."""
        if self.ranks:
            raise ValueError("this model is a reranker; it scores pairs and makes no embeddings")
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

    def answer(self, inputs: Sequence[str], truncate: bool, dimensions: int | None,
               query: str | None) -> tuple[list[tuple[float, ...]], int]:
        """What an embed request asks: the inputs' vectors, or with a `query` a reranker's
        scores of them (each a vector of one value), and the tokens read."""
        if query is None:
            return self.embed(inputs, truncate, dimensions)
        scores, total = self.rank(query, inputs, truncate)
        return [(score,) for score in scores], total

    def rank(self, query: str, documents: Sequence[str],
             truncate: bool = True) -> tuple[list[float], int]:
        """Each document's score against `query`, and the tokens read over all pairs. A pair
        longer than the context loses the end of its document (or, with `truncate` False, is
        refused: EmbedInputError)."""
        if not self.ranks:
            raise ValueError("this model cannot rank documents: it is not a reranker (a GGUF "
                             "with rank pooling, such as bge-reranker or Qwen3-Reranker)")
        scores, total = [], 0
        for i, document in enumerate(documents):
            tokens = self._pair(query, document)
            if len(tokens) > self.n_ctx:
                if not truncate:
                    raise EmbedInputError(
                        f"document {i} with the query is {len(tokens)} tokens, more than the "
                        f"reranking context of {self.n_ctx} (send truncate: true to cut it)")
                tokens = tokens[: self.n_ctx]
            total += len(tokens)
            scores.append(self._pooled(tokens)[0])
        return scores, total

    def _pair(self, query: str, document: str) -> list[int]:
        """The query and a document as one input, as llama.cpp's server reads them."""
        template = llama_cpp.llama_model_chat_template(self.model, b"rerank")
        if template:
            text = template.decode("utf-8", errors="replace")
            text = text.replace("{query}", query).replace("{document}", document)
            return self.tokenize(text, add_special=False, special=True)
        vocab = self.vocab
        eos = llama_cpp.llama_vocab_eos(vocab)
        if eos == llama_cpp.LLAMA_TOKEN_NULL:
            eos = llama_cpp.llama_vocab_sep(vocab)
        tokens = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(
            vocab) else []
        tokens += self.tokenize(query, add_special=False)
        if llama_cpp.llama_vocab_get_add_eos(vocab):
            tokens.append(eos)
        if llama_cpp.llama_vocab_get_add_sep(vocab):
            tokens.append(llama_cpp.llama_vocab_sep(vocab))
        tokens += self.tokenize(document, add_special=False)
        if llama_cpp.llama_vocab_get_add_eos(vocab):
            tokens.append(eos)
        return tokens

    def _pool(self, tokens: list[int], dimensions: int | None) -> tuple[float, ...]:
        if not tokens:
            return tuple(0.0 for _ in range(dimensions or self.n_embd))
        values = self._mean(tokens) if self.mean_here else self._pooled(tokens)
        if dimensions:
            values = values[:dimensions]
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        return tuple(v / norm for v in values)

    def _run(self, tokens: list[int], start: int) -> None:
        fill(self.batch, tokens, start, all_logits=True)
        run = llama_cpp.llama_encode if self.encoder else llama_cpp.llama_decode
        rc = run(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama.cpp failed to embed the input (code {rc})")

    def _pooled(self, tokens: list[int]) -> list[float]:
        """One input's output pooled by llama.cpp, read whole from an empty context."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        self._run(tokens, 0)
        pointer = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not pointer:
            raise RuntimeError("llama.cpp returned no pooled embedding")
        # the pooled output of one input: its embedding, or a reranker's scores
        width = max(1, llama_cpp.llama_model_n_cls_out(self.model)) if self.ranks else self.n_embd
        return ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float))[:width]

    def _mean(self, tokens: list[int]) -> list[float]:
        """Mean pooling of a causal LM's token states, read `chunk` tokens at a time (the
        earlier ones stay in the KV cache, so each token sees the whole input before it)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        total = numpy.zeros(self.n_embd, dtype=numpy.float64)
        for start in range(0, len(tokens), self.chunk):
            part = tokens[start:start + self.chunk]
            self._run(part, start)
            pointer = llama_cpp.llama_get_embeddings(self.ctx)
            if not pointer:
                raise RuntimeError("llama.cpp returned no token embeddings")
            states = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float))
            total += numpy.ctypeslib.as_array(states, (len(part), self.n_embd)).sum(axis=0)
        return (total / len(tokens)).tolist()
