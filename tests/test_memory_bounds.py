"""Memory the daemon keeps for clients is counted as what it really holds."""

from __future__ import annotations

import gc
import tracemalloc

from localllm.daemon.api.responses import StoredResponses


def test_a_stored_response_holds_about_what_it_is_counted_as():
    history = ({"role": "user", "content": "hi"},)
    stored = StoredResponses(max_bytes=256 << 20)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    # As a request's body arrives: parsed objects, about 10 MiB as JSON.
    metadata = {f"k{i}": f"v{i}" for i in range(600_000)}
    response = {"id": "resp_1", "metadata": metadata, "output": []}
    stored.put(response, history)
    del response, metadata
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    counted = stored.size
    assert counted > 9 << 20
    assert held < 1.5 * counted, f"holds {held >> 20} MiB, counted {counted >> 20} MiB"
    again = stored.get("resp_1")
    assert again.response["metadata"]["k599999"] == "v599999"
    assert again.history == history
