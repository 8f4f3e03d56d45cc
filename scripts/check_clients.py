#!/usr/bin/env python3
"""Check a running daemon against what editors and apps depend on; print PASS or FAIL per case.

    python -m scripts.check_clients                          # the daemon at LOCALLLM_HOST
    python -m scripts.check_clients --url http://127.0.0.1:11434 --model smollm2

Each case names the client whose source it comes from (see docs/ and the README's API section).
Tools and fill-in-the-middle are checked both ways: a model whose /api/show lists the
capability must do it, one that does not must answer Ollama's 400. Standard library only, so it
runs from any Python. Exit status: 0 when every case passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PERSON = {"$defs": {"Pet": {"type": "object", "properties": {
              "kind": {"enum": ["cat", "dog"], "type": "string"}, "name": {"type": "string"}},
              "required": ["kind", "name"]}},
          "type": "object", "properties": {
              "name": {"type": "string"}, "age": {"type": "integer"},
              "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]}},
          "required": ["name", "age", "pet"]}
QUICK = {"temperature": 0, "num_predict": 120}


class Failed(Exception):
    pass


class Client:
    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def call(self, path: str, body=None, method: str | None = None) -> tuple[int, str, str]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), e.read().decode()

    def json(self, path: str, body=None, method: str | None = None, status: int = 200) -> dict:
        code, _, text = self.call(path, body, method)
        expect(code == status, f"{path} answered {code}, not {status}: {text[:200]}")
        return json.loads(text)


def expect(condition, message: str) -> None:
    if not condition:
        raise Failed(message)


def check_person(value) -> None:
    """The schema's rules, checked by hand so the script needs nothing installed."""
    expect(isinstance(value, dict), "not an object")
    expect(isinstance(value.get("name"), str), "name is not a string")
    expect(isinstance(value.get("age"), int) and not isinstance(value["age"], bool),
           "age is not an integer")
    pet = value.get("pet", "missing")
    expect(pet is None or (isinstance(pet, dict) and pet.get("kind") in ("cat", "dog")
                           and isinstance(pet.get("name"), str)), f"bad pet {pet!r}")


def cases(c: Client, model: str) -> list[tuple[str, Callable[[], None]]]:
    show_cache: dict = {}

    def show() -> dict:
        if not show_cache:
            show_cache.update(c.json("/api/show", {"model": model}))
        return show_cache

    def root():
        code, _, text = c.call("/")
        expect(code == 200 and text == "Ollama is running", f"GET / said {text!r}")

    def version():
        v = c.json("/api/version")["version"]
        parts = tuple(int(p) for p in re.sub(r"^v|-.*", "", v).split("."))
        expect(parts >= (0, 6, 4), f"version {v} is below VS Code's minimum 0.6.4")

    def tags():
        models = c.json("/api/tags")["models"]
        expect(models, "no models listed")
        for m in models:
            for key in ("name", "model", "modified_at", "size", "digest"):
                expect(key in m, f"{m.get('name')} lacks {key}")
            expect(":" in m["model"], f"{m['model']} has no :tag (Open WebUI needs one)")
            for key in ("format", "family", "parameter_size", "quantization_level"):
                expect(isinstance(m["details"].get(key), str), f"details.{key} not a string")

    def show_every_model():
        for m in c.json("/api/tags")["models"]:
            s = c.json("/api/show", {"model": m["model"]})
            expect(isinstance(s.get("capabilities"), list), f"{m['model']}: no capabilities")
            expect(isinstance(s.get("model_info"), dict), f"{m['model']}: no model_info")

    def show_parameters():
        s = c.json("/api/show", {"name": model})
        values = {}
        for line in s["parameters"].splitlines():
            found = re.match(r'^(\S+)\s+((?:".*")|\S+)$', line)
            expect(found, f"parameters line {line!r} does not parse")
            values.setdefault(found.group(1), []).append(found.group(2))
        expect(int(values["num_ctx"][0]) > 0, "no num_ctx")
        for stop in values.get("stop", []):
            json.loads(stop)
        arch = s["model_info"]["general.architecture"]
        expect(f"{arch}.context_length" in s["model_info"], "no <arch>.context_length")

    def load_unload():
        r = c.json("/api/generate", {"model": model, "prompt": ""})
        expect(r["done_reason"] == "load", f"done_reason {r.get('done_reason')}")
        r = c.json("/api/generate", {"model": model, "prompt": "", "keep_alive": 0})
        expect(r["done_reason"] == "unload", f"done_reason {r.get('done_reason')}")

    def chat_stream():
        code, ctype, text = c.call("/api/chat", {
            "model": model, "stream": True, "keep_alive": -1, "think": None,
            "messages": [{"role": "user", "content": "Say hi."}],
            "options": {"num_ctx": 2048, "num_predict": 8}})
        expect(code == 200 and ctype.startswith("application/x-ndjson"), f"{code} {ctype}")
        lines = [json.loads(x) for x in text.splitlines() if x]
        expect(lines[-1].get("done") is True, "the stream does not end with done:true")
        for line in lines:
            expect({"model", "created_at", "message", "done"} <= line.keys(), f"line {line}")
            expect(isinstance(line["message"]["content"], str), "content is not a string")

    def format_schema():
        r = c.json("/api/chat", {"model": model, "stream": False, "format": PERSON,
                                 "options": QUICK, "messages": [
                                     {"role": "user", "content": "Invent a person with a pet."}]})
        check_person(json.loads(r["message"]["content"]))

    def embed():
        r = c.json("/api/embed", {"model": model, "input": ["def add(a, b):", "return a + b"]})
        expect(len(r["embeddings"]) == 2, "not one vector per input")
        for v in r["embeddings"]:
            expect(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3, "not unit length")

    def openai_stream_usage():
        code, ctype, text = c.call("/v1/chat/completions", {
            "model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
        expect(code == 200 and ctype.startswith("text/event-stream"), f"{code} {ctype}")
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        expect(events[-1] == "[DONE]", "no [DONE]")
        usage = json.loads(events[-2])
        expect(usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0, "no usage")

    def openai_json_schema():
        r = c.json("/v1/chat/completions", {
            "model": model, "max_tokens": 120, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": PERSON}},
            "messages": [{"role": "user", "content": "Invent a person with a pet."}]})
        check_person(json.loads(r["choices"][0]["message"]["content"]))

    def tools():
        body = {"model": model, "stream": False, "tools": [WEATHER], "options": QUICK,
                "tool_choice": "required",
                "messages": [{"role": "user", "content": "Weather in Paris?"}]}
        if "tools" not in show()["capabilities"]:
            code, _, text = c.call("/api/chat", body)
            expect(code == 400 and "does not support tools" in text, f"{code} {text[:120]}")
            return
        calls = c.json("/api/chat", body)["message"].get("tool_calls") or []
        expect(calls and calls[0]["function"]["name"] == "get_weather", "no get_weather call")
        expect(isinstance(calls[0]["function"]["arguments"], dict), "arguments not an object")
        r = c.json("/v1/chat/completions", {
            "model": model, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]})
        choice = r["choices"][0]
        expect(choice["finish_reason"] == "tool_calls", f"finish {choice['finish_reason']}")
        json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])

    def insert():
        body = {"model": model, "prompt": "def add(a, b):\n    ", "suffix": "\n    return c",
                "stream": False, "options": {"num_predict": 8}}
        if "insert" not in show()["capabilities"]:
            code, _, text = c.call("/api/generate", body)
            expect(code == 400 and "does not support insert" in text, f"{code} {text[:120]}")
            return
        expect(isinstance(c.json("/api/generate", body)["response"], str), "no response")

    def v1_models():
        ids = {m["id"] for m in c.json("/v1/models")["data"]}
        expect(any(i.split(":")[0] == model.split(":")[0] for i in ids), f"{model} not in {ids}")

    return [
        ("GET / says 'Ollama is running' (probing clients)", root),
        ("/api/version >= 0.6.4, numeric (VS Code, Open WebUI)", version),
        ("/api/tags strict fields (Zed, Open WebUI)", tags),
        ("/api/show succeeds for every model (Zed, VS Code)", show_every_model),
        ("/api/show {name} parameters parse (Continue, LiteLLM)", show_parameters),
        ("empty prompt loads, keep_alive 0 unloads (Continue, Open WebUI)", load_unload),
        ("/api/chat NDJSON stream lines (Zed)", chat_stream),
        ("format with $defs/$ref/anyOf validates (LangChain)", format_schema),
        ("/api/embed unit vectors (Continue, Open WebUI)", embed),
        ("/v1 stream with include_usage (VS Code)", openai_stream_usage),
        ("/v1 response_format json_schema validates (Open WebUI, LiteLLM)", openai_json_schema),
        ("tools: a forced call, or Ollama's 400 (Zed, VS Code)", tools),
        ("suffix: fill-in-the-middle, or Ollama's 400 (Continue)", insert),
        ("/v1/models lists the model (VS Code, Open WebUI)", v1_models),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    host = os.environ.get("LOCALLLM_HOST", "127.0.0.1:11434")
    parser.add_argument("--url", default=host if "://" in host else f"http://{host}")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)
    client = Client(args.url)
    failed = 0
    for name, case in cases(client, args.model):
        try:
            case()
            print(f"PASS  {name}")
        except (Failed, KeyError, ValueError, urllib.error.URLError) as e:
            failed += 1
            print(f"FAIL  {name}: {type(e).__name__}: {e}")
    print(f"{len(cases(client, args.model)) - failed} passed, {failed} failed ({args.model} at "
          f"{args.url})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
