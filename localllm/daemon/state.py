"""Typed application state shared by the daemon's routes (aiohttp AppKeys)."""

from __future__ import annotations

from aiohttp import web
from localllm.modelstore.store import ModelStore

from localllm.config import Config

from .scheduler import Scheduler

STORE = web.AppKey("store", ModelStore)
SCHEDULER = web.AppKey("scheduler", Scheduler)
CONFIG = web.AppKey("config", Config)


def live_config(app: web.Application) -> Config:
    """The config in force now: app[CONFIG] is the one the daemon started with (aiohttp's
    state is fixed once it runs), while config.toml's later edits reach the scheduler
    (server.py: _apply_config). Settings applied `live` are read here."""
    return app[SCHEDULER].config


def aliases_json(app: web.Application) -> dict:
    """localllm's addition to /api/tags and /api/ps: the other names models answer to
    (model_aliases), where there are any (Ollama's shape is kept exactly otherwise)."""
    aliases = live_config(app).model_aliases
    return {"aliases": aliases} if aliases else {}
