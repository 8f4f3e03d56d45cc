"""Images through the real `ollama` and `openai` clients, a real daemon and real mtmd, with the
synthetic Gemma 3 pair (scripts/synth_vision.py): a tiny language model and a projector
of the real tensor table, weights drawn at random, 64 image tokens per image."""

from __future__ import annotations

import base64
import io
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import ollama
import openai
import pytest
from scripts import synth_gguf
from scripts import synth_vision
from PIL import Image

from localllm.modelstore.store import PROJECTOR_LAYER, ModelStore

GREEDY = {"num_predict": 8, "temperature": 0, "seed": 1}
IMAGE_TOKENS = 64  # tiny_projector: 224 px / 14 px patches / 2x2 pooling
WRAP_TOKENS = 2  # <start_of_image> and <end_of_image>, which mtmd writes around it


def image_bytes(color, fmt="PNG", size=(40, 30)) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", size, color)
    for x in range(size[0]):  # a gradient: the pooled patches differ from each other
        image.putpixel((x, x * size[1] // size[0]), (255 - color[0], x * 6 % 256, 99))
    image.save(out, fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


RED, BLUE = b64(image_bytes((220, 20, 30))), b64(image_bytes((10, 40, 230)))
GREEN = b64(image_bytes((20, 200, 40), "JPEG"))
GIF = b64(image_bytes((200, 200, 40), "GIF"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return synth_vision.write_vision_pair(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vdaemon(tmp_path_factory, pair, smollm2_gguf):
    from daemon_process import isolated_env, start_daemon

    # The slot's own cache only: the RAM prompt cache would give back images read by earlier
    # tests, and these count what one request reads (tests/test_prompt_cache.py covers it).
    env = isolated_env(tmp_path_factory.mktemp("vision-daemon"), LOCALLLM_NUM_PARALLEL="1",
                       LOCALLLM_PROMPT_CACHE_RAM="0")
    store = ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")
    model, mmproj = pair
    store.import_gguf(model, "vl", projector=mmproj)
    store.import_gguf(model, "vl-text")  # the same model without its projector
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oc(vdaemon):
    return ollama.Client(host=vdaemon.url)


@pytest.fixture(scope="module")
def ai(vdaemon):
    return openai.OpenAI(base_url=vdaemon.url + "/v1", api_key="unused")


def post(daemon, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(daemon.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(oc, images=(), text="What is this?", model="vl", **kw):
    message = {"role": "user", "content": text}
    if images:
        message["images"] = list(images)
    return oc.chat(model=model, messages=[message], options={**GREEDY, **kw})


def test_import_stores_the_projector_and_show_reports_vision(vdaemon, oc, pair):
    assert "vision" in oc.show("vl").capabilities
    assert "vision" not in oc.show("vl-text").capabilities
    _, shown = post(vdaemon, "/api/show", {"model": "vl"})  # (the client drops projector_info)
    assert shown["projector_info"]["clip.projector_type"] == "gemma3"
    assert shown["projector_info"]["clip.vision.projection_dim"] == 256
    assert "projector_info" not in post(vdaemon, "/api/show", {"model": "vl-text"})[1]
    store = ModelStore(Path(vdaemon.env["XDG_DATA_HOME"]) / "localllm" / "models")
    layer = store.get("vl").companion(PROJECTOR_LAYER)
    assert layer.media_type == "application/vnd.ollama.image.projector"
    assert layer.size == pair[1].stat().st_size


def test_an_image_changes_the_greedy_answer_and_counts_its_tokens(oc):
    without = ask(oc)
    with_red = ask(oc, [RED])
    assert with_red.message.content != without.message.content
    # (prompt_eval_count is the whole input, the image's tokens among them)
    assert with_red.prompt_eval_count >= IMAGE_TOKENS + WRAP_TOKENS
    with_blue = ask(oc, [BLUE])
    assert with_blue.message.content != with_red.message.content


def test_same_image_reuses_the_cache_and_another_is_read_again(oc, vdaemon):
    first = ask(oc, [RED], text="Describe the colours.")
    again = ask(oc, [RED], text="Describe the colours.")
    assert again.message.content == first.message.content
    # One token is always read again (its logits start the answer); the image is not.
    assert again.prompt_eval_count == first.prompt_eval_count  # the whole input, as Ollama
    last = next(m for m in vdaemon.get("/api/stats")["models"] if m["model"] == "vl:latest")
    assert last["last"]["prompt_eval_count"] == 1 and last["last"]["cached_tokens"] > 0
    other = ask(oc, [BLUE], text="Describe the colours.")
    assert other.prompt_eval_count >= IMAGE_TOKENS + WRAP_TOKENS


def test_openai_image_url_parts_and_usage(ai, oc):
    def chat(parts):
        return ai.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": parts}], max_tokens=8,
            temperature=0, seed=1)

    text_only = chat([{"type": "text", "text": "What is this?"}])
    url = f"data:image/png;base64,{RED}"
    with_image = chat([{"type": "text", "text": "What is this?"},
                       {"type": "image_url", "image_url": {"url": url}}])
    assert with_image.usage.prompt_tokens >= text_only.usage.prompt_tokens + IMAGE_TOKENS
    assert with_image.choices[0].message.content != text_only.choices[0].message.content
    # Two images in one message, and the same chat as Ollama's `images` reads the same prompt
    # when the image comes first.
    two = chat([{"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{BLUE}"}},
                {"type": "text", "text": "Which is red?"}])
    assert two.usage.prompt_tokens >= text_only.usage.prompt_tokens + 2 * IMAGE_TOKENS
    first = chat([{"type": "image_url", "image_url": {"url": url}},
                  {"type": "text", "text": "What is this?"}])
    via_ollama = ask(oc, [RED])
    assert first.choices[0].message.content == via_ollama.message.content


def test_images_in_earlier_turns_and_generate(oc):
    history = [{"role": "user", "content": "Look.", "images": [GREEN]},  # (a JPEG)
               {"role": "assistant", "content": "A green picture."},
               {"role": "user", "content": "And this?", "images": [GIF]}]
    r = oc.chat(model="vl", messages=history, options=GREEDY)
    assert r.prompt_eval_count >= 2 * IMAGE_TOKENS
    plain = oc.generate(model="vl", prompt="Tell me what this is.", options=GREEDY)
    g = oc.generate(model="vl", prompt="Tell me what this is.", images=[RED], options=GREEDY)
    assert g.prompt_eval_count >= IMAGE_TOKENS + WRAP_TOKENS
    assert g.response != plain.response


def truncated_png() -> str:
    raw = image_bytes((1, 2, 3))
    return b64(raw[: len(raw) // 2])


def png_bomb(width: int = 20000, height: int = 20000) -> str:
    """A small, whole PNG whose header declares width x height pixels of one colour (the
    zlib stream of its rows compresses about 1000:1; decoding it costs width x height x 3)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = zlib.compressobj(9)
    data = b"".join(rows.compress(b"\x00" + bytes(width * 3)) for _ in range(200))
    data += rows.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b64(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data)
               + chunk(b"IEND", b""))


@pytest.mark.parametrize("image, expected", [
    (png_bomb(), "is 20000 x 20000 pixels, more than the 33 megapixels"),
    (b64(b"hello, this is plain text"), "is not an image"),
    ("@@not base64@@", "is not valid base64"),
    (truncated_png(), "truncated PNG"),
    (b64(b"II*\x00" + bytes(64)), "TIFF file, an unsupported format"),
])
def test_bad_images_get_a_400_naming_the_problem(vdaemon, image, expected):
    status, body = post(vdaemon, "/api/chat", {
        "model": "vl", "stream": False, "options": GREEDY,
        "messages": [{"role": "user", "content": "hi", "images": [image]}]})
    assert status == 400
    assert expected in body["error"] and "messages[0].images[0]" in body["error"]


def test_model_without_projector_and_too_many_images(vdaemon, oc):
    status, body = post(vdaemon, "/api/chat", {
        "model": "vl-text", "stream": False,
        "messages": [{"role": "user", "content": "hi", "images": [RED]}]})
    assert status == 400
    assert "vl-text" in body["error"] and "does not support images" in body["error"]
    # A context too small for the images: the runner refuses it and stays up.
    status, body = post(vdaemon, "/api/chat", {
        "model": "vl", "stream": False, "options": {**GREEDY, "num_ctx": 256},
        "messages": [{"role": "user", "content": "hi", "images": [RED] * 5}]})
    assert status == 400 and "5 images" in body["error"]
    after = ask(oc, [RED])  # the daemon and the runner are fine
    assert after.done and after.prompt_eval_count > 0


def test_image_urls_fetched_refused_and_failing(vdaemon, tmp_path):
    import http.server
    import threading

    png = base64.b64decode(RED)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/red.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/private":
                self.send_response(302)
                self.send_header("Location", "http://10.1.2.3/x.png")
                self.end_headers()
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def chat(url):
            return post(vdaemon, "/v1/chat/completions", {
                "model": "vl", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}}]}]})

        status, body = chat(f"{base}/red.png")
        assert status == 200 and body["usage"]["prompt_tokens"] > IMAGE_TOKENS
        status, body = chat(f"{base}/missing.png")
        assert status == 400 and f"{base}/missing.png" in body["error"]["message"]
        missing = body["error"]["message"].replace(f"{base}/missing.png", "URL")
        status, body = chat(f"{base}/private")
        assert status == 400 and "private address" in body["error"]["message"]
        # The first URL is held to the same rule as a redirect: no private, link-local or
        # metadata address is fetched (refused before any connection: no 10 s timeout).
        for inside in ("http://10.1.2.3/x.png", "http://169.254.169.254/latest/meta-data",
                       "http://[fd00::1]/x.png", "http://[::ffff:192.168.1.1]/x.png"):
            status, body = chat(inside)
            assert status == 400 and "is a private address" in body["error"]["message"], inside
        # Refused, no such host and "not there" read the same: the fetcher maps no ports.
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/x.png"
        closed.close()
        for url in (refused, "http://no-such-host.invalid/x.png"):
            status, body = chat(url)
            assert status == 400
            assert body["error"]["message"].replace(url, "URL") == missing
    finally:
        server.shutdown()


def test_pull_of_a_hub_repo_brings_its_projector_and_show_reports_vision(tmp_path_factory,
                                                                          pair):
    """The fake hub's repo holds the model and two projectors: the pull stores the model and
    the f16 one (not the f32) as its projector layer, and the model then takes images."""
    from daemon_process import isolated_env, start_daemon
    from hub_server import Hub

    from localllm.modelstore.store import sha256_file

    model, mmproj = pair
    tmp_path = tmp_path_factory.mktemp("pull")  # (short: the daemon's socket path must fit)
    f32 = synth_vision.write_projector(tmp_path / "mmproj-f32.gguf",
                                     synth_vision.tiny_projector(synth_gguf.tiny(
                                         synth_gguf.SHAPES["gemma3-27b"])), seed=7)
    with Hub() as hub:
        hub.add("test/VL-GGUF", "vl-Q8_0.gguf", model)
        hub.add("test/VL-GGUF", "mmproj-vl-f32.gguf", f32)
        hub.add("test/VL-GGUF", "mmproj-vl-f16.gguf", mmproj)
        env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT=hub.url)
        d = start_daemon(env)
        try:
            oc = ollama.Client(host=d.url)
            assert oc.pull("hf.co/test/VL-GGUF").status == "success"
            name = "hf.co/test/VL-GGUF"
            assert "vision" in oc.show(name).capabilities
            store = ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")
            entry = store.get(name)
            assert entry.digest == "sha256:" + sha256_file(model)
            assert entry.companion(PROJECTOR_LAYER).digest == "sha256:" + sha256_file(mmproj)
            r = oc.chat(model=name, options=GREEDY,
                        messages=[{"role": "user", "content": "hi", "images": [RED]}])
            assert r.prompt_eval_count >= IMAGE_TOKENS
        finally:
            d.stop()


def test_run_attaches_the_image_files_a_prompt_names(vdaemon, tmp_path):
    from localllm.image_paths import attach_images

    photo = tmp_path / "photo.png"
    photo.write_bytes(base64.b64decode(RED))
    text, images = attach_images("what is in ./photo.png? and missing.png", cwd=tmp_path)
    assert text == "what is in ? and missing.png" and [i.path for i in images] == [photo]
    result = vdaemon.cli("run", "vl", f"what is in {photo}?", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "added image photo.png" in result.stderr
    plain = vdaemon.cli("run", "vl", "what is in?", "--verbose")
    assert plain.returncode == 0 and "added image" not in plain.stderr


def test_anthropic_image_blocks_and_responses_input_image(vdaemon, oc):
    """The agents' wire formats hand their images to the same chat layer: an image first and
    the same text read the same prompt, and give the same greedy answer, as Ollama's `images`."""
    import anthropic

    via_ollama = ask(oc, [RED])
    claude = anthropic.Anthropic(base_url=vdaemon.url, api_key="x", max_retries=0)
    m = claude.messages.create(model="vl", max_tokens=8, extra_body={"temperature": 0, "seed": 1},
                               messages=[{"role": "user", "content": [
                                   {"type": "image", "source": {
                                       "type": "base64", "media_type": "image/png", "data": RED}},
                                   {"type": "text", "text": "What is this?"}]}])
    assert m.content[0].text == via_ollama.message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens >= IMAGE_TOKENS
    codex = openai.OpenAI(base_url=vdaemon.url + "/v1", api_key="x", max_retries=0)
    r = codex.responses.create(model="vl", max_output_tokens=8, temperature=0,
                               extra_body={"seed": 1}, input=[{"role": "user", "content": [
                                   {"type": "input_image",
                                    "image_url": f"data:image/png;base64,{RED}"},
                                   {"type": "input_text", "text": "What is this?"}]}])
    assert r.output_text == via_ollama.message.content


async def test_the_chat_tui_attaches_an_image_path_typed_in_a_message(vdaemon, tmp_path):
    """As `run MODEL "what is in ./photo.png?"` does: the TUI sends the file with the turn,
    notes it, and the path leaves the text."""
    from test_tui_app import config_for, notes, type_line, wait_loaded, wait_until

    from localllm.tui.app import ChatApp
    from localllm.tui.chatstore import ChatStore

    photo = tmp_path / "photo.png"
    photo.write_bytes(base64.b64decode(RED))
    chats = ChatStore(tmp_path / "chats.db")
    app = ChatApp(config_for(vdaemon), "vl", store=chats)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot, app)
            await type_line(pilot, app, "/set parameter num_predict 4")
            await type_line(pilot, app, f"what is in {photo}?")
            await wait_until(pilot, lambda: not app.streaming and app.chat.turn
                             and app.chat.turn.done, "the answer")
            assert any("added image photo.png" in n for n in notes(app))
            user = next(e for e in app.chat.entries if e.role == "user")
            assert user.content == "what is in ?" and len(user.images) == 1
            # The image's tokens are in the context with the text (read now, or reused from
            # the cache when an earlier test sent the same image at the same place).
            assert app.chat.turn.context_used >= IMAGE_TOKENS + app.chat.turn.eval_count
        # Reopened, the chat sends the image with its turn again: the next answer's context
        # holds it as well as the text.
        again = ChatApp(config_for(vdaemon), "vl", store=chats, resume=str(app.chat.chat_id))
        async with again.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot, again)
            user = next(e for e in again.chat.entries if e.role == "user")
            assert user.images == (base64.b64encode(photo.read_bytes()).decode(),)
            await type_line(pilot, again, "/set parameter num_predict 4")
            await type_line(pilot, again, "and now?")
            await wait_until(pilot, lambda: not again.streaming and again.chat.turn
                             and again.chat.turn.done and again.chat.turn.eval_count,
                             "the second answer")
            assert again.chat.turn.context_used >= IMAGE_TOKENS + again.chat.turn.eval_count
    finally:
        chats.close()


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_images_are_decoded_one_at_a_time(vdaemon, oc):
    """Three 24-megapixel images (72 MiB each decoded): the runner's peak grows by about one
    decoded image, not three (each is resized for the projector, then its bitmap freed)."""
    big = []
    for shade in (10, 120, 230):
        out = io.BytesIO()
        Image.new("RGB", (6000, 4000), (shade, 40, 99)).save(out, "PNG")
        big.append(b64(out.getvalue()))
    oc.chat(model="vl", messages=[{"role": "user", "content": "hi", "images": [RED]}],
            options={"num_predict": 1})
    pid = next(m["runner_pid"] for m in vdaemon.get("/api/stats")["models"]
               if m["model"] == "vl:latest")
    before = _peak_rss(pid)
    reply = oc.chat(model="vl", messages=[{"role": "user", "content": "what are these?",
                                           "images": big}], options={"num_predict": 1})
    assert reply.prompt_eval_count >= 3 * IMAGE_TOKENS
    grew = _peak_rss(pid) - before
    decoded = 6000 * 4000 * 3
    print(f"peak grew {grew >> 20} MiB for three images of {decoded >> 20} MiB decoded")
    assert grew < 2.5 * decoded
