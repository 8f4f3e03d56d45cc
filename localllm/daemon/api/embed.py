"""Embedding routes: Ollama's /api/embed and legacy /api/embeddings, OpenAI's /v1/embeddings;
and reranking, /v1/rerank (and /api/rerank), in llama.cpp server's shapes.

All three read unit-length vectors from the model's Engine (engine/seam.py): the runner's
embedding context (engine/embedding.py: the GGUF's pooling, or mean pooling for a causal model, so
any stored model embeds), or a remote model's upstream /embeddings.
"""

from __future__ import annotations

import base64
import struct
import time

from aiohttp import web
from localllm.engine.runner.protocol import Embeddings, EmbedRequest

from localllm.engine.runner.protocol import new_request_id
from .common import (
    bad_request,
    find_model,
    get_bool,
    get_model_field,
    get_number,
    get_str,
    read_json,
)
from .ollama import ollama_options, parse_keep_alive
from .respond import hold, served_model

routes = web.RouteTableDef()


def get_inputs(body: dict, key: str) -> tuple[str, ...]:
    value = body.get(key)
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise bad_request(f"invalid input type: field '{key}' must be a string or a list of "
                      f"strings", key)


async def _embed(request: web.Request, body: dict, inputs: tuple[str, ...], truncate: bool,
                 dimensions: int | None, query: str | None = None
                 ) -> tuple[Embeddings, int, int]:
    """(embeddings, load ns, total ns) of `inputs` with the body's model; with `query`, a
    reranker's scores of the inputs against it (one per vector)."""
    started, started_wall = time.perf_counter_ns(), time.time()
    entry = find_model(request, get_model_field(body))
    _, load = ollama_options(body)
    async with hold(request.app, entry, load, parse_keep_alive(body)) as engine:
        load_ns = engine.load_duration_ns if engine.loaded_at >= started_wall else 0
        result = await engine.embed(EmbedRequest(id=new_request_id(), inputs=inputs,
                                                 truncate=truncate, dimensions=dimensions,
                                                 query=query))
    return result, load_ns, time.perf_counter_ns() - started


@routes.post("/api/embed")
async def api_embed(request: web.Request) -> web.Response:
    body = await read_json(request)
    inputs = get_inputs(body, "input")
    name = get_model_field(body)
    if not inputs:
        find_model(request, name)  # an unknown model is still a 404
        return web.json_response({"model": name, "embeddings": []})
    dimensions = get_number(body, "dimensions", int, 1)
    result, load_ns, total_ns = await _embed(request, body, inputs,
                                             get_bool(body, "truncate", True), dimensions)
    return web.json_response({"model": name, "embeddings": [list(v) for v in result.vectors],
                              "total_duration": total_ns, "load_duration": load_ns,
                              "prompt_eval_count": result.prompt_tokens})


@routes.post("/api/embeddings")
async def api_embeddings(request: web.Request) -> web.Response:
    """The legacy route: one `prompt`, one `embedding`."""
    body = await read_json(request)
    prompt = get_str(body, "prompt", default="")
    if not prompt:
        find_model(request, get_model_field(body))
        return web.json_response({"embedding": []})
    result, _, _ = await _embed(request, body, (prompt,), True, None)
    return web.json_response({"embedding": list(result.vectors[0])})


@routes.post("/v1/embeddings")
async def v1_embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    inputs = get_inputs(body, "input")
    if not inputs:
        raise bad_request("field 'input' must be a non-empty string or list of strings", "input")
    encoding = get_str(body, "encoding_format", default="float")
    if encoding not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
    dimensions = get_number(body, "dimensions", int, 1)
    result, _, _ = await _embed(request, body, inputs, True, dimensions)

    def encode(vector: tuple[float, ...]):
        if encoding == "float":
            return list(vector)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    data = [{"object": "embedding", "index": i, "embedding": encode(v)}
            for i, v in enumerate(result.vectors)]
    return web.json_response({"object": "list", "data": data, "model": get_model_field(body),
                              "usage": {"prompt_tokens": result.prompt_tokens,
                                        "total_tokens": result.prompt_tokens}})


# ---- reranking -------------------------------------------------------------------------------
@routes.post("/v1/rerank")
@routes.post("/v1/reranking")
@routes.post("/api/rerank")
async def rerank(request: web.Request) -> web.Response:
    """llama.cpp server's rerank: `query`, `documents` (or TEI's `texts`), `top_n` ->
    `results` [{index, relevance_score}], the most relevant first, on a reranker (a GGUF with
    rank pooling, loaded as any model is); any other model is a 400 before it loads.
    `return_documents` adds each one's text as `document: {text}` (Jina's and Cohere's)."""
    body = await read_json(request)
    name = get_model_field(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("field 'query' must be a non-empty string", "query")
    key = "documents" if "documents" in body else "texts"
    documents = get_inputs(body, key)
    if not documents:
        raise bad_request(f"field '{key}' must be a non-empty list of strings", key)
    top_n = get_number(body, "top_n", int, 1) or len(documents)
    entry = find_model(request, name)
    if entry.remote is not None or not (await served_model(entry, None)).ranks:
        raise bad_request(f"model {name!r} cannot rank documents: it is not a reranker (a GGUF "
                          f"with rank pooling, such as bge-reranker or Qwen3-Reranker); "
                          f"/v1/embeddings takes an embedding model", "model")
    result, _, _ = await _embed(request, body, documents, get_bool(body, "truncate", True),
                                None, query)
    ranked = sorted(((i, vector[0]) for i, vector in enumerate(result.vectors)),
                    key=lambda pair: pair[1], reverse=True)[:top_n]
    with_text = get_bool(body, "return_documents", False)
    results = [{"index": i, "relevance_score": score,
                **({"document": {"text": documents[i]}} if with_text else {})}
               for i, score in ranked]
    return web.json_response({"model": name, "object": "list", "results": results,
                              "usage": {"prompt_tokens": result.prompt_tokens,
                                        "total_tokens": result.prompt_tokens}})
