"""Filling a llama_batch with one sequence's tokens: written once, for every single-sequence
caller (evaluation, embeddings, tune --measure). The runner's engine fills batches of several
sequences, drafts and images, and keeps its own."""

from __future__ import annotations


def fill(batch, tokens: list[int], start: int = 0, seq: int = 0,
         all_logits: bool = False) -> None:
    """`tokens` at positions start.. of sequence `seq`; logits for the last token only, or for
    every one with `all_logits`."""
    batch.n_tokens = len(tokens)
    last = len(tokens) - 1
    for i, token in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if all_logits or i == last else 0
