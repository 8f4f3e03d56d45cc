"""GET /metrics read with prometheus_client's own text-format parser, for the tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, headers: dict | None = None) -> dict[str, dict]:
    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: {tuple(sorted(s.labels.items())) + ((("__name__", s.name),)): s.value
                     for s in f.samples} for f in text_string_to_metric_families(text)}


def value(families, family: str, sample: str, **labels) -> float:
    key = tuple(sorted({**labels, "__name__": sample}.items()))
    return {tuple(sorted(k)): v for k, v in families.get(family, {}).items()}.get(key, 0.0)
