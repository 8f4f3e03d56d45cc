"""Embeddings, /api/show as editors read it, the probes clients make (`GET /`, /api/version),
load and unload with an empty prompt, /api/create with /api/blobs, and chat truncation: real
clients against a real daemon with the real SmolLM2."""

from __future__ import annotations

import hashlib
import json
import math
import re
import urllib.error
import urllib.request

import ollama
import openai
import pytest
from chat_models import QWEN_TOOL_TEMPLATE, tool_model
from conftest import import_models


@pytest.fixture(scope="module")
def md(tmp_path_factory, smollm2_gguf):
    from daemon_process import isolated_env, start_daemon

    root = tmp_path_factory.mktemp("models")
    env = isolated_env(root / "home")
    import_models(env, {"smollm2": smollm2_gguf, "smollm2-tools": tool_model(smollm2_gguf, root)})
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oc(md):
    return ollama.Client(host=md.url)


def request(daemon, path: str, body=None, method: str = "POST", data: bytes | None = None):
    if data is None and body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(daemon.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


# ---- embeddings ----------------------------------------------------------------------------
def test_embed_gives_unit_vectors_and_paraphrases_are_closer(oc):
    texts = ["The cat is sleeping on the sofa.", "A cat naps on the couch.",
             "Interest rates rose by half a percent."]
    r = oc.embed(model="smollm2", input=texts)
    assert len(r.embeddings) == 3 and len(r.embeddings[0]) == 576  # SmolLM2's n_embd
    for v in r.embeddings:
        assert abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4
    a, b, c = r.embeddings
    assert cosine(a, b) > cosine(a, c) and cosine(a, b) > cosine(b, c)
    assert r.prompt_eval_count > 10 and r.total_duration > 0
    single = oc.embed(model="smollm2", input=texts[0])
    assert single.embeddings[0] == pytest.approx(a, abs=1e-5)


def test_embed_dimensions_truncate_and_empty_input(md, oc):
    r = oc.embed(model="smollm2", input="hello world", dimensions=64)
    assert len(r.embeddings[0]) == 64
    assert abs(sum(x * x for x in r.embeddings[0]) - 1) < 1e-4
    code, text = request(md, "/api/embed", {"model": "smollm2", "input": []})
    assert code == 200 and json.loads(text)["embeddings"] == []
    # Past a 512-token context (the embedding context is the loaded one's): cutting reads 512
    # tokens, where past the default context it would read thousands.
    long_text, small = "word " * 700, {"num_ctx": 512}
    code, text = request(md, "/api/embed", {"model": "smollm2", "input": long_text,
                                            "truncate": False, "options": small})
    assert code == 400 and "exceeds the context length" in json.loads(text)["error"]
    cut = oc.embed(model="smollm2", input=long_text, options=small)
    assert len(cut.embeddings[0]) == 576 and cut.prompt_eval_count == 512
    code, text = request(md, "/api/embed", {"model": "smollm2", "input": 5})
    assert code == 400 and "invalid input type" in json.loads(text)["error"]
    code, _ = request(md, "/api/embed", {"model": "ghost", "input": "x"})
    assert code == 404


def test_legacy_and_openai_embeddings_agree(md, oc):
    new = oc.embed(model="smollm2", input="local models").embeddings[0]
    code, text = request(md, "/api/embeddings", {"model": "smollm2", "prompt": "local models"})
    assert code == 200 and json.loads(text)["embedding"] == pytest.approx(new, abs=1e-5)
    ai = openai.OpenAI(base_url=md.url + "/v1", api_key="unused")
    r = ai.embeddings.create(model="smollm2", input=["local models", "other"])  # base64 wire
    assert [d.index for d in r.data] == [0, 1]
    assert r.data[0].embedding == pytest.approx(new, abs=1e-5)
    assert r.usage.prompt_tokens > 0


# ---- /api/show and the probes ----------------------------------------------------------------
def test_show_as_clients_read_it(md, oc):
    show = oc.show("smollm2")
    assert show.capabilities == ["completion"]
    assert show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.context_length"] == 8192
    assert "<|im_start|>" in show.template
    # Continue's reading: `^(\S+)\s+((?:".*")|\S+)$`, stop values JSON-parsed.
    params = {}
    for line in show.parameters.splitlines():
        key, value = re.match(r'^(\S+)\s+((?:".*")|\S+)$', line).groups()
        params.setdefault(key, []).append(value)
    assert int(params["num_ctx"][0]) > 0
    assert [json.loads(v) for v in params["stop"]] == ["<|im_end|>"]
    assert all(isinstance(v, str) for k, v in show.details if k != "families" and v is not None)
    tools = oc.show("smollm2-tools")
    assert tools.capabilities == ["completion", "tools", "insert"]
    code, text = request(md, "/api/show", {"name": "smollm2"})  # Continue's and LiteLLM's key
    assert code == 200 and json.loads(text)["capabilities"] == ["completion"]
    code, _ = request(md, "/api/show", {"name": "ghost"})
    assert code == 404


def test_root_and_version_probes(md):
    with urllib.request.urlopen(md.url + "/", timeout=10) as resp:
        assert resp.read().decode() == "Ollama is running"
    version = md.get("/api/version")
    # VS Code's gate: numeric parts, at least 0.6.4; Open WebUI parses it as ints.
    assert tuple(map(int, version["version"].split("."))) >= (0, 6, 4)
    assert version["localllm_version"] == md.get("/api/status")["version"]


def test_empty_prompt_loads_and_keep_alive_zero_unloads(md):
    code, text = request(md, "/api/generate", {"model": "smollm2", "prompt": ""})
    assert code == 200 and json.loads(text)["done_reason"] == "load"
    assert "smollm2:latest" in {m["model"] for m in md.ps()}
    code, text = request(md, "/api/generate", {"model": "smollm2", "prompt": "",
                                               "keep_alive": 0})
    assert code == 200 and json.loads(text)["done_reason"] == "unload"
    assert "smollm2:latest" not in {m["model"] for m in md.ps()}


# ---- /api/create and /api/blobs --------------------------------------------------------------
def test_create_from_a_modelfile_sets_parameters_system_and_template(md, oc):
    modelfile = ('FROM smollm2\nPARAMETER num_ctx 1024\nPARAMETER temperature 0\n'
                 'PARAMETER stop "<|im_end|>"\nPARAMETER stop "END"\n'
                 'SYSTEM """You are a pirate.\nAlways say arr."""\n'
                 f'TEMPLATE """{QWEN_TOOL_TEMPLATE}"""\n')
    code, text = request(md, "/api/create", {"model": "pirate", "modelfile": modelfile,
                                             "stream": False})
    assert code == 200 and json.loads(text)["status"] == "success", text
    show = json.loads(request(md, "/api/show", {"model": "pirate"})[1])
    assert show["system"] == "You are a pirate.\nAlways say arr."
    assert "num_ctx                        1024" in show["parameters"]
    assert '"END"' in show["parameters"] and "temperature" in show["parameters"]
    assert "tools" in show["capabilities"]  # the Modelfile's template takes tools
    assert 'SYSTEM """You are a pirate.' in show["modelfile"]
    r = oc.chat(model="pirate", messages=[{"role": "user", "content": "hi"}],
                options={"num_predict": 4})
    loaded = {m.model: m for m in oc.ps().models}
    assert loaded["pirate:latest"].context_length == 1024
    base = oc.chat(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                   options={"num_predict": 4})
    assert r.prompt_eval_count != base.prompt_eval_count  # the pirate system prompt is in
    # The base model is untouched; removing the new one keeps the shared GGUF.
    assert json.loads(request(md, "/api/show", {"model": "smollm2"})[1])["system"] == ""
    oc.delete("pirate")
    assert oc.show("smollm2").modelinfo["general.architecture"] == "llama"


def test_create_from_an_uploaded_blob(md, oc, smollm2_gguf):
    data = smollm2_gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    fake = "sha256:" + "0" * 64
    code, _ = request(md, f"/api/blobs/{fake}", method="HEAD")
    assert code == 404
    code, text = request(md, f"/api/blobs/{fake}", data=b"not this")
    assert code == 400 and "digest mismatch" in json.loads(text)["error"]
    assert oc.create_blob(smollm2_gguf) == digest
    code, _ = request(md, f"/api/blobs/{digest}", method="HEAD")
    assert code == 200
    oc.create(model="from-blob", files={"model.gguf": digest}, system="Be brief.",
              parameters={"num_predict": 3})
    r = oc.generate(model="from-blob", prompt="Say something.")
    assert r.eval_count <= 3
    assert json.loads(request(md, "/api/show", {"model": "from-blob"})[1])["system"] == \
        "Be brief."


@pytest.mark.parametrize("modelfile,fragment", [
    ("FROM smollm2\nADAPTER ./lora.gguf", "ADAPTER is not supported"),
    ("FROM smollm2\nPARAMETER temperature hot", "temperature must be a number"),
    ("FROM smollm2\nPARAMETER wobble 3", "unknown PARAMETER"),
    ("FROM ghost-model", "not found"),
    ("PARAMETER num_ctx 512", "needs a base"),
])
def test_bad_modelfiles_get_clear_400s(md, modelfile, fragment):
    code, text = request(md, "/api/create", {"model": "bad", "modelfile": modelfile})
    assert code in (400, 404) and fragment in json.loads(text)["error"]
    assert "bad:latest" not in {m["name"] for m in md.get("/api/tags")["models"]}


# ---- truncation ----------------------------------------------------------------------------
def test_long_chat_drops_the_oldest_turns_or_refuses(md, oc):
    system = {"role": "system", "content": "You are terse."}
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Question {i}: " + "tell me more " * 30},
                  {"role": "assistant", "content": f"Answer {i}: " + "fine " * 30}]
    messages = [system, *turns, {"role": "user", "content": "Last question: name a colour."}]
    options = {"num_ctx": 512, "num_predict": 8, "temperature": 0}
    r = oc.chat(model="smollm2", messages=messages, options=options)
    assert r.done and r.prompt_eval_count + r.eval_count <= 512
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="smollm2", messages=messages, options={**options, "truncate": False})
    assert e.value.status_code == 400 and "context" in e.value.error
    short = oc.chat(model="smollm2", messages=[system, messages[-1]], options=options)
    # The kept prompt holds the system prompt and the last question, and more than those alone.
    assert r.prompt_eval_count > short.prompt_eval_count


# ---- the editors' checklist ----------------------------------------------------------------
@pytest.mark.parametrize("model", ["smollm2", "smollm2-tools"])
def test_check_clients_script_passes(md, model):
    """scripts/check_clients.py, as CI runs it: every case passes, for a model without tools
    and FIM (the 400s) and for one with them (the calls and the insert)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "scripts.check_clients", "--url", md.url,
                           "--model", model], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASS") == 14 and "FAIL" not in done.stdout


def test_check_clients_script_reports_failures(md):
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "scripts.check_clients", "--url", md.url,
                           "--model", "ghost"], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "FAIL  /api/show {name} parameters parse" in done.stdout
    assert "PASS  GET / says 'Ollama is running'" in done.stdout
