"""The llama.cpp side of a runner: load a model with a Plan, turn a request into tokens.

Runs inside the runner process only (see runner.py): a crash in here takes down that process,
never the daemon. The decode loop is our own rather than `Llama.generate` so that cancellation,
stop strings, timings and KV-prefix reuse are exact.
"""

from __future__ import annotations

import codecs
import ctypes
import random
import threading
import time
from collections.abc import Callable

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_grammar import LlamaGrammar
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from localllm.profiles.plan import Plan

from .protocol import Done, EmbedRequest, Embeddings, Event, Failure, GenerationRequest, Token

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
              "bf16": 30, "iq4_nl": 20}


class RequestError(Exception):
    """The request cannot be served as asked (status 400): prompt too long, no chat template."""


def load_llama(model_path: str, plan: Plan) -> Llama:
    kwargs = dict(
        model_path=model_path,
        n_gpu_layers=plan.n_gpu_layers,
        n_ctx=plan.n_ctx,
        n_batch=plan.n_batch,
        n_ubatch=plan.n_ubatch,
        n_threads=plan.n_threads,
        n_threads_batch=plan.n_threads_batch,
        flash_attn=plan.flash_attn,
        swa_full=plan.swa_full,
        type_k=GGML_TYPES[plan.type_k],
        type_v=GGML_TYPES[plan.type_v],
        use_mmap=plan.use_mmap,
        verbose=False,
    )
    if plan.tensor_split:
        kwargs["tensor_split"] = list(plan.tensor_split)
    if plan.tensor_overrides:
        from localllm.profiles.llama_overrides import tensor_overrides_applied

        with tensor_overrides_applied(plan.tensor_overrides):
            return Llama(**kwargs)
    return Llama(**kwargs)


class StopMatcher:
    """Holds back text that might be the start of a stop string, so none is ever streamed."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Engine:
    def __init__(self, model_path: str, plan: Plan):
        self.plan = plan
        self.llm = load_llama(model_path, plan)
        self.n_ctx = self.llm.n_ctx()
        self.vocab = self.llm._model.vocab
        template = self.llm.metadata.get("tokenizer.chat_template")
        self.formatter = None
        if template:
            eos = self._piece(self.llm.token_eos())
            bos = self._piece(self.llm.token_bos())
            self.formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        self.add_bos = self.llm._model.add_bos_token()
        self.embedder = None  # made on the first embed request
        self.tokens_generated = 0  # over the runner's life, for its log

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        return self.llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    # ---- prompt ------------------------------------------------------------------------
    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            return self._templated(list(request.messages))
        prompt = request.prompt or ""
        if not request.raw and self.formatter is not None:
            messages = [{"role": "system", "content": request.system}] if request.system else []
            return self._templated(messages + [{"role": "user", "content": prompt}])
        if request.system and not request.raw:
            prompt = f"{request.system}\n\n{prompt}"
        return self.raw_tokens(prompt)

    def raw_tokens(self, text: str) -> list[int]:
        """A raw prompt: special tokens parsed; BOS added when the model adds one and the text
        (a template the chat layer rendered, say) does not already start with it."""
        bos = self._piece(self.llm.token_bos())
        add_bos = self.add_bos and not (bos and text.startswith(bos))
        return self.llm.tokenize(text.encode(), add_bos=add_bos, special=True)

    def count_tokens(self, text: str) -> int:
        return len(self.raw_tokens(text))

    def embed(self, request: EmbedRequest) -> Embeddings:
        """Embeddings in a context of their own, made on first use (see embedding.py)."""
        if self.embedder is None:
            from .embedding import Embedder

            arch = self.llm.metadata.get("general.architecture", "")
            pooling = self.llm.metadata.get(f"{arch}.pooling_type")
            self.embedder = Embedder(self.llm._model.model, self.n_ctx, self.plan.n_threads,
                                     self.plan.n_threads_batch,
                                     int(pooling) if pooling is not None else None)
        return self.embedder.embed(request)

    def _templated(self, messages: list[dict]) -> list[int]:
        if self.formatter is None:
            raise RequestError("this model has no chat template; use /api/generate or "
                               "/v1/completions with a plain prompt")
        try:
            rendered = self.formatter(messages=messages)
        except Exception as e:
            raise RequestError(f"the chat template rejected these messages: {e}") from None
        # A template that writes the BOS token itself must not get a second one.
        add_bos = self.add_bos and not rendered.prompt.startswith(self._piece(self.llm.token_bos()))
        return self.llm.tokenize(rendered.prompt.encode(), add_bos=add_bos, special=True)

    def _reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the KV cache for the longest common prefix; return how many tokens were kept."""
        cached = self.llm.input_ids[: self.llm.n_tokens].tolist()
        common = 0
        for a, b in zip(cached, tokens, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last prompt token is evaluated for logits
        if common > 0 and self.llm._ctx.kv_cache_seq_rm(-1, common, -1):
            self.llm.n_tokens = common
            return common
        # Sliding-window and recurrent caches cannot drop a suffix: start over.
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        return 0

    # ---- generation --------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancelled: threading.Event,
                 emit: Callable[[Event], None]) -> None:
        try:
            self._generate(request, cancelled, emit)
        except RequestError as e:
            emit(Failure(str(e), status=400))

    def _generate(self, request, cancelled, emit) -> None:
        opts = request.options
        tokens = self.prompt_tokens(request)
        if request.grammar:
            self._check_grammar(request.grammar)
        if len(tokens) >= self.n_ctx:
            raise RequestError(
                f"the prompt is {len(tokens)} tokens but the context is {self.n_ctx}; "
                f"shorten it or load the model with a larger num_ctx"
            )
        t0 = time.perf_counter_ns()
        cached = self._reuse_prefix(tokens)
        self.llm.eval(tokens[cached:])
        prompt_ns = time.perf_counter_ns() - t0

        seed = opts.seed if opts.seed is not None and opts.seed >= 0 else random.getrandbits(31)
        self.llm.set_seed(seed)
        self.llm.last_n_tokens_size = opts.repeat_last_n if opts.repeat_last_n > 0 else self.n_ctx
        sampler = self.llm._init_sampler(
            top_k=opts.top_k, top_p=opts.top_p, min_p=opts.min_p, typical_p=opts.typical_p,
            temp=opts.temperature, repeat_penalty=opts.repeat_penalty,
            frequency_penalty=opts.frequency_penalty, presence_penalty=opts.presence_penalty,
            grammar=LlamaGrammar.from_string(request.grammar) if request.grammar else None,
        )
        limit = opts.num_predict if opts.num_predict >= 0 else self.n_ctx
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(opts.stop)
        answer: list[int] = []
        reason = "length"
        t1 = time.perf_counter_ns()
        pending_tokens = 0
        pending_logprobs: list[dict] = []

        def token_event(text: str, n_tokens: int) -> Token:
            logprobs = tuple(pending_logprobs) if request.logprobs is not None else None
            pending_logprobs.clear()
            return Token(text, n_tokens, logprobs=logprobs, eval_count=len(answer),
                         eval_duration_ns=time.perf_counter_ns() - t1,
                         prompt_eval_count=len(tokens) - cached,
                         prompt_eval_duration_ns=prompt_ns,
                         context_used=len(tokens) + len(answer))

        while len(answer) < limit:
            if cancelled.is_set():
                reason = "cancelled"
                break
            if self.llm.n_tokens >= self.n_ctx:
                break  # context full
            token = sampler.sample(self.llm._ctx, -1)
            if request.logprobs is not None and not llama_cpp.llama_vocab_is_eog(self.vocab,
                                                                                token):
                pending_logprobs.append(self._logprobs(token, request.logprobs))
            if llama_cpp.llama_vocab_is_eog(self.vocab, token):
                reason = "stop"
                break
            answer.append(token)
            self.tokens_generated += 1
            pending_tokens += 1
            text, hit = stops.feed(decoder.decode(self._token_bytes(token)))
            if text:
                emit(token_event(text, pending_tokens))
                pending_tokens = 0
            if hit:
                reason = "stop"
                break
            self.llm.eval([token])
        eval_ns = time.perf_counter_ns() - t1
        if reason != "stop":
            tail = stops.flush() + decoder.decode(b"", final=True)
            if tail:
                emit(token_event(tail, pending_tokens))
        emit(Done(
            done_reason=reason,
            prompt_eval_count=len(tokens) - cached,
            prompt_eval_duration_ns=prompt_ns,
            eval_count=len(answer),
            eval_duration_ns=eval_ns,
            prompt_tokens=len(tokens),
            cached_tokens=cached,
            context_used=self.llm.n_tokens,
            n_ctx=self.n_ctx,
            context=tuple(tokens + answer),
        ))

    def _check_grammar(self, grammar: str) -> None:
        """llama.cpp returns no sampler for a grammar it cannot parse, and a chain holding that
        crashes the runner: try it alone first."""
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            raise RequestError("llama.cpp rejected the grammar made for this request's format")
        llama_cpp.llama_sampler_free(sampler)

    def _token_bytes(self, token: int) -> bytes:
        # special=True: control tokens the chat layer parses (<think>, gpt-oss's <|channel|>)
        # must reach it as text; end-of-generation tokens never get here.
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def _logprobs(self, token: int, top_n: int) -> dict:
        """The sampled token's log-probability under the model (before sampling settings)
        and the `top_n` most likely tokens: OpenAI's logprobs entry."""
        import numpy as np

        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1),
                                       shape=(n_vocab,)).astype(np.float64)
        top = logits.max()
        logprobs = logits - (top + np.log(np.exp(logits - top).sum()))

        def entry(t: int) -> dict:
            data = self._token_bytes(t)
            return {"token": data.decode("utf-8", errors="replace"),
                    "logprob": float(logprobs[t]), "bytes": list(data)}

        best = []
        if top_n > 0:  # a partial sort: the whole vocabulary per token would cost more
            best = np.argpartition(-logprobs, top_n)[:top_n]
            best = best[np.argsort(-logprobs[best])]
        return {**entry(token), "top_logprobs": [entry(int(t)) for t in best]}
