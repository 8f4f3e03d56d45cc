"""One request's sampler: a llama.cpp sampler chain, built from the request's options.

The order is Ollama's and llama.cpp's: penalties, grammar, then top-k, typical, top-p, min-p,
temperature and the random draw. The penalty sampler is fed the prompt first, as Ollama does,
so a repeat penalty also covers what the user wrote. Greedy decoding with nothing else in the
chain skips llama.cpp's candidate array (a copy of the whole vocabulary per token) and takes the
argmax of the logits in place.
"""

from __future__ import annotations

import random

import llama_cpp
import numpy as np

from localllm.options import SamplingOptions


class RequestError(Exception):
    """The request cannot be served as asked (status 400): prompt too long, bad grammar."""


class Sampler:
    def __init__(self, vocab, n_vocab: int, options: SamplingOptions, grammar: str | None,
                 prompt: list[int], n_ctx: int):
        self.n_vocab = n_vocab
        self.chain = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params())
        last_n = n_ctx if options.repeat_last_n < 0 else options.repeat_last_n
        penalize = last_n > 0 and (options.repeat_penalty != 1.0
                                   or options.frequency_penalty != 0.0
                                   or options.presence_penalty != 0.0)
        self.greedy = options.temperature <= 0
        self.fast_greedy = self.greedy and not penalize and not grammar
        if penalize:
            penalties = llama_cpp.llama_sampler_init_penalties(
                n_vocab, last_n, options.repeat_penalty, options.frequency_penalty,
                options.presence_penalty)
            for token in prompt[-last_n:]:
                llama_cpp.llama_sampler_accept(penalties, token)
            self._add(penalties)
        if grammar:
            compiled = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not compiled:
                self.free()
                raise RequestError("the grammar does not parse (GBNF with a 'root' rule)")
            self._add(compiled)
        if self.greedy:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        if options.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(options.top_k))
        if 0 < options.typical_p < 1:
            self._add(llama_cpp.llama_sampler_init_typical(options.typical_p, 1))
        if 0 < options.top_p < 1:
            self._add(llama_cpp.llama_sampler_init_top_p(options.top_p, 1))
        if options.min_p > 0:
            self._add(llama_cpp.llama_sampler_init_min_p(options.min_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(options.temperature))
        seed = options.seed if options.seed is not None and options.seed >= 0 \
            else random.getrandbits(31)
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def _add(self, sampler) -> None:
        llama_cpp.llama_sampler_chain_add(self.chain, sampler)

    def logits(self, ctx, index: int) -> np.ndarray:
        """The logits of batch row `index`, in place (valid until the next decode)."""
        pointer = llama_cpp.llama_get_logits_ith(ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def sample(self, ctx, index: int) -> int:
        """The next token from batch row `index`; the chain also records it (penalties,
        grammar state)."""
        if self.fast_greedy:
            return int(self.logits(ctx, index).argmax())
        return llama_cpp.llama_sampler_sample(self.chain, ctx, index)

    def accept(self, token: int) -> None:
        """Record a token chosen earlier (a sampler rebuilt mid-answer catches up)."""
        llama_cpp.llama_sampler_accept(self.chain, token)

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


def log_probs(logits: np.ndarray, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its `top_n` likeliest tokens (raw logits,
    before the sampler's temperature and cuts, as OpenAI reports them)."""
    top = logits.max()
    log_sum = float(top + np.log(np.exp(logits - top).sum()))
    chosen = float(logits[token]) - log_sum
    if top_n <= 0:
        return chosen, []
    best = np.argpartition(-logits, top_n)[:top_n]
    best = best[np.argsort(-logits[best])]
    return chosen, [(int(t), float(logits[t]) - log_sum) for t in best]
