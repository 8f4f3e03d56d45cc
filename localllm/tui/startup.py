"""Getting the chat ready: the daemon connected (started if need be), the model stored
(pulled if the user agrees) and loaded, each step on the app's progress line and in its notes."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from localllm.client import DaemonError
from localllm.errors import UserError
from localllm.units import human_size

from .slash import NO_TEMPLATE, base_model_text

# What a lost or refused connection to the daemon looks like from aiohttp.
CONNECTION_ERRORS = (aiohttp.ClientError, ConnectionError, OSError, asyncio.TimeoutError)


class Startup:
    """The app's startup and `/load`: run inside the app's `prepare` worker. `app` is the
    ChatApp (not imported here: it imports this)."""

    def __init__(self, app):
        self.app = app
        self.shown: dict = {}  # /api/show of the model last asked for

    async def prepare(self, model: str, offer_pull: bool = True) -> None:
        app = self.app
        progress = app.progress_line
        try:
            try:
                await app.client.connect(start=False)
            except UserError:
                progress.start("Starting the daemon…")
                await app.client.connect(start=True)
            app.connected = True
            if not await self.ensure_model(model, offer_pull):
                return
            app.switch_model(model)
            progress.start(f"Loading {model}: choosing a plan for this machine…")
            started = time.monotonic()
            body = {"model": model, "messages": []}
            if app.chat.options:
                body["options"] = app.chat.options
            reply = await app.client.request("POST", "/api/chat", body)
            app.chat.stored_name = reply.get("model", model)
            await app._poll_runner_once()
            app.note(app._loaded_text(model, time.monotonic() - started))
            if self.shown.get("template", "") in NO_TEMPLATE:
                app.note(base_model_text(model))
        except DaemonError as e:
            app.note(app._explain(e, model) if e.status == 404 else
                     f"Cannot load {model}: {e}", "error")
        except UserError as e:
            app.note(str(e), "error")
        except CONNECTION_ERRORS:
            app.connected = False
            await app.client.close()  # the next request reconnects (and starts the daemon)
            app.note(lost_daemon_text(f"while loading {model}",
                                      f"/load {model} starts it again."), "error")
        finally:
            progress.stop()

    async def ensure_model(self, model: str, offer_pull: bool) -> bool:
        """True when the model is stored. When it is not: with offer_pull (the model named on
        the command line, before the user types), a question whether to pull it; else (a
        typed /load) a note on how to pull it. A question there would take the keys the user
        typed on after /load, and a typed-ahead Enter would answer it."""
        app = self.app
        try:
            self.shown = await app.client.request("POST", "/api/show", {"model": model})
            await self.list_models()
            return True
        except DaemonError as e:
            if e.status != 404:
                raise
        if not offer_pull:
            app.note(f"{model} is not in the store: {not_stored_hint(model, app.models)}",
                     "warning")
            return False
        from .screens import ConfirmScreen

        if not await app.push_screen_wait(ConfirmScreen(
                f"{model} is not in the store. Pull it now?", "Pull", "Cancel")):
            app.note(f"{model} is not stored; /load another model.", "warning")
            return False
        progress = app.progress_line
        progress.start(f"Pulling {model}…")
        sizes: dict[str, int] = {}  # per blob
        async for status in app.client.pull(model):
            label = f"Pulling {model}: {status.get('status', '')}"
            if status.get("total"):
                progress.advance(label, status.get("completed", 0), status["total"])
                sizes[status.get("digest", status["status"])] = status["total"]
            else:  # "verifying sha256 digest", "writing manifest": the bar stays where it got
                progress.label(label)
        app.note(f"Pulled {model} ({human_size(sum(sizes.values()))}).")
        await self.list_models()
        return True

    async def list_models(self) -> None:
        app = self.app
        data = await app.client.request("GET", "/api/tags")
        app.models[:] = [m["name"].removesuffix(":latest") for m in data.get("models", [])]


def lost_daemon_text(when: str, what_now: str) -> str:
    return (f"Lost the connection to the daemon {when}: it stopped or crashed "
            f"(`localllm service logs` shows its log). {what_now}")


def not_stored_hint(model: str, stored: list[str]) -> str:
    others = [m for m in stored if m != model]
    load = f"/load one of {', '.join(others[:6])}" if others else "/load another model"
    return f"pull it with `localllm pull {model}` in a shell and /load it again, or {load}."
