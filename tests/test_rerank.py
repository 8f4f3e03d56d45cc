"""/v1/rerank and /api/rerank in llama.cpp server's shapes (query, documents or TEI's texts,
top_n -> results [{index, relevance_score}], the highest first), and the 400 for a model that
cannot rank. Real daemon, real llama.cpp.

No real reranker GGUF ships in a package here, so the ranker is SmolLM2 with its header saying
rank pooling (`llama.pooling_type = 4`): llama.cpp then scores a pair by the first value of the
last token's hidden state (a causal model's rank row; no classifier head). Those scores mean
nothing about relevance and are not known in advance, so what is tested is the shape, that
the order is the scores' order, that each document's score is its own (the same alone as among
others), and the refusals; not that relevant documents come first."""

from __future__ import annotations

import httpx
import pytest

from daemon_process import isolated_env, start_daemon
from gguf_edit import with_metadata

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.",
        "Bananas are rich in potassium.",
        "The Eiffel Tower stands in Paris.",
        "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def rank_daemon(tmp_path_factory, smollm2_gguf):
    from conftest import import_models

    root = tmp_path_factory.mktemp("rerank")
    env = isolated_env(root)
    ranker = with_metadata(smollm2_gguf, root / "ranker.gguf", {"llama.pooling_type": 4})
    import_models(env, {"ranker": ranker, "smollm2": smollm2_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


def _post(daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(daemon.url + path, json=body, timeout=120)


def test_rerank_answers_in_llama_cpp_servers_shape_highest_first(rank_daemon):
    r = _post(rank_daemon, "/v1/rerank", {"model": "ranker", "query": QUERY,
                                          "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "ranker" and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert len(results) == 3 and set(results[0]) == {"index", "relevance_score"}
    assert len({x["index"] for x in results}) == 3 <= len(DOCS)
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    # Each score is the document's own: the same ranked alone, and the one left out is lowest.
    everything = _post(rank_daemon, "/api/rerank", {"model": "ranker", "query": QUERY,
                                                    "documents": DOCS}).json()["results"]
    assert len(everything) == len(DOCS) and everything[:3] == results
    for x in everything:
        alone = _post(rank_daemon, "/v1/rerank", {"model": "ranker", "query": QUERY,
                                                  "documents": [DOCS[x["index"]]]}).json()
        assert alone["results"] == [{"index": 0, "relevance_score": x["relevance_score"]}]
    assert len({x["relevance_score"] for x in everything}) > 1  # they depend on the document


def test_texts_and_return_documents_are_taken(rank_daemon):
    r = _post(rank_daemon, "/v1/reranking", {"model": "ranker", "query": QUERY,
                                             "texts": DOCS[:2], "return_documents": True})
    assert r.status_code == 200, r.text
    for x in r.json()["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}


def test_a_model_that_cannot_rank_is_a_400_before_it_loads(rank_daemon):
    r = _post(rank_daemon, "/v1/rerank", {"model": "smollm2", "query": QUERY,
                                          "documents": DOCS})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "model"
    assert "'smollm2' cannot rank documents: it is not a reranker" in error["message"]
    r = _post(rank_daemon, "/api/rerank", {"model": "smollm2", "query": QUERY,
                                           "documents": DOCS})
    assert r.status_code == 400 and "cannot rank documents" in r.json()["error"]
    assert not any(m["model"].startswith("smollm2") for m in rank_daemon.ps())
    # And a reranker asked for embeddings says what it is.
    r = _post(rank_daemon, "/v1/embeddings", {"model": "ranker", "input": "hello"})
    assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"documents": DOCS}, "query"),
    ({"query": "", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
])
def test_bad_requests_are_400s_naming_the_field(rank_daemon, body, param):
    r = _post(rank_daemon, "/v1/rerank", {"model": "ranker", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(rank_daemon, "/v1/rerank", {"model": "no-such-model", "query": QUERY,
                                          "documents": DOCS})
    assert r.status_code == 404
