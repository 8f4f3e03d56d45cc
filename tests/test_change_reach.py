"""How many files two common changes touch, counted from the code's own registries.

- A new chat-like route: its wire module (the route, its body read into the one `ChatRequest`,
  its `Writer`) and the one line that adds the module's routes to the app, in the route table.
  Shown by doing it: a wire format made up here, in a module of its own, answers a real chat on
  the small test model through the response pipeline, with nothing else of the daemon changed.
- A new tuner setting: the settings table (`localllm/config.py`: the field with its variable
  and the words or bounds it takes, its line in the table), the tuner Request's field of the
  same name (`localllm/planner/search.py`) and the planning module that reads it.
  `choose.config_request` passes a setting the Request names as the config does with no line of
  its own, shown with a setting made up here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import json
import tokenize
import types
from pathlib import Path

import pytest

from localllm.config import Config, ConfigError, check_setting
from localllm.daemon.server import create_app
from localllm.planner.search import Request
from localllm.profiles import choose

ROOT = Path(__file__).resolve().parent.parent

# A wire format no client speaks: a chat in, the answer as lines of text out (streamed), or
# one JSON object (whole). Everything it needs is the daemon's, as a new route's module would.
WIRE_MODULE = '''
import uuid

from aiohttp import web

from localllm.daemon.api.common import body_options, get_messages, read_json, requested_model
from localllm.daemon.api.respond import Writer, respond
from localllm.daemon.chat.request import ChatRequest

routes = web.RouteTableDef()


class LinesWriter(Writer):
    headers = {"Content-Type": "text/plain; charset=utf-8"}

    def whole(self, parsed, done, logprobs):
        return {"text": parsed.content, "tokens": done.eval_count, "why": done.done_reason}

    async def part(self, part):
        await self.write(part.parsed.content.encode())

    async def done(self, part):
        await self.write(f"{part.parsed.content}\\n-- {part.event.eval_count} tokens\\n".encode())

    async def error(self, message):
        await self.write(f"\\n-- error: {message}\\n".encode())


@routes.post("/lines/chat")
async def lines_chat(request):
    body = await read_json(request)
    entry, custom = await requested_model(request, body)
    sampling, load = body_options(body, {"max_tokens": "num_predict"}, custom.parameters)
    chat = ChatRequest(id=uuid.uuid4().hex, model_name=entry.name.tagged, options=sampling,
                       load=load, messages=get_messages(body))
    return await respond(request, chat, LinesWriter(), entry=entry, custom=custom,
                         stream=bool(body.get("stream")))
'''


def product_files():
    yield from sorted((ROOT / "localllm").rglob("*.py"))


def route_table_files() -> set[str]:
    """The files that add routes to the app (`add_routes`, `router.add_*`): the route table."""
    found = set()
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and (node.func.attr == "add_routes"
                         or node.func.attr.startswith("add_") and isinstance(
                             node.func.value, ast.Attribute) and node.func.value.attr == "router")):
                found.add(str(path.relative_to(ROOT)))
    return found


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_a_new_chat_like_route_is_its_module_and_a_line_in_the_route_table(
        aiohttp_client, store, smollm2_gguf, tmp_path):
    table = route_table_files()
    assert table == {"localllm/daemon/server.py"}, table
    wire = tmp_path / "lines_wire.py"
    wire.write_text(WIRE_MODULE)
    store.import_gguf(smollm2_gguf, "smollm2")
    app = create_app(Config(), store)
    app.add_routes(load_module(wire).routes)  # the line the route table would get
    client = await aiohttp_client(app)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 6, "temperature": 0}
    whole = await client.post("/lines/chat", json=chat)
    assert whole.status == 200, await whole.text()
    answer = await whole.json()
    assert answer["text"].strip() and 0 < answer["tokens"] <= 6 and answer["why"] == "length"
    streamed = await client.post("/lines/chat", json={**chat, "stream": True})
    assert streamed.status == 200
    assert streamed.headers["Content-Type"].startswith("text/plain")
    text = await streamed.text()
    assert text.startswith(answer["text"]) and text.endswith(f"-- {answer['tokens']} tokens\n")
    # the pipeline's own checks answer for the new route too: an unknown model is a 404
    missing = await client.post("/lines/chat", json={**chat, "model": "no-such-model"})
    assert missing.status == 404 and "no-such-model" in json.dumps(await missing.json())
    touched = {str(wire)} | table
    assert len(touched) == 2, touched


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """The modules a file imports (relative imports resolved; `from a import b`: a and a.b)."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else module_name(path)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = (f"{base}.{node.module}" if node.module else base) if node.level \
                else node.module
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


def test_no_module_below_the_api_names_a_wire_module():
    """What lets a route be one module: below the API (the pipeline, the chat layer, the
    scheduler, the runner, the tuner) nothing imports a chat route's wire module."""
    app = create_app(Config())
    chat_modules = {route.handler.__module__ for route in app.router.routes()
                    if route.method == "POST" and "respond" in vars(
                        importlib.import_module(route.handler.__module__))}
    assert {"localllm.daemon.api.ollama", "localllm.daemon.api.openai",
            "localllm.daemon.api.anthropic", "localllm.daemon.api.responses"} <= chat_modules
    table = route_table_files()
    # the route table imports every one of them (so `imported` sees such imports)
    assert chat_modules <= set().union(*(imported(ROOT / rel) for rel in table))
    for path in product_files():
        rel = str(path.relative_to(ROOT))
        if not rel.startswith("localllm/daemon/api/") and rel not in table:
            assert not imported(path) & chat_modules, (rel, imported(path) & chat_modules)


def files_naming(name: str) -> set[str]:
    """The product files that name a setting: as a field or keyword (`name:`, `name=`), an
    attribute (`.name`) or a string of its own ("name")."""
    found = set()
    for path in product_files():
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type in (tokenize.NAME, tokenize.OP, tokenize.STRING)]
        for i, t in enumerate(tokens):
            if (t.type == tokenize.STRING and t.string.strip("\"'") == name) or (
                    t.type == tokenize.NAME and t.string == name
                    and ((i and tokens[i - 1].string == ".")
                         or (i + 1 < len(tokens) and tokens[i + 1].string in ("=", ":")))):
                found.add(str(path.relative_to(ROOT)))
                break
    return found


def source_of(thing) -> str:
    """The file of ours that defines `thing` (a module, or a class)."""
    module = thing if isinstance(thing, types.ModuleType) else importlib.import_module(
        thing.__module__)
    return str(Path(module.__file__).relative_to(ROOT))


def test_a_new_tuner_setting_is_the_settings_table_the_request_and_its_reader(monkeypatch):
    # a setting made up here reaches the tuner's Request with no line in choose.py
    new = dataclasses.make_dataclass("NewConfig", [("new_knob", str, "off")], bases=(Config,),
                                     frozen=True)
    asked = dataclasses.make_dataclass("NewRequest", [("new_knob", str, "off")],
                                       bases=(Request,), frozen=True)
    monkeypatch.setattr(choose, "Config", new)
    monkeypatch.setattr(choose, "Request", asked)
    assert choose.config_request(config=new(new_knob="on")).new_knob == "on"
    monkeypatch.undo()
    # a real one, expert_misses (auto, cpu or gpu; read by the planning of the expert pool):
    # the files that name it are those tables and the module that reads it, nothing between
    registries = {source_of(Config), source_of(Request)}
    assert "expert_misses" in choose.same_names()
    files = files_naming("expert_misses")
    readers = files - registries
    assert registries <= files, files
    assert readers and all(f.startswith("localllm/planner/") for f in readers), readers
    assert len(files) <= 3, sorted(files)
    # its words are declared with its field, and the check applies them from there
    declared = {f.name: f for f in dataclasses.fields(Config)}["expert_misses"]
    assert declared.metadata["words"] == ("auto", "cpu", "gpu")
    with pytest.raises(ConfigError, match="expert_misses must be one of auto, cpu, gpu"):
        check_setting("expert_misses", "fast")
