"""Typed application state shared by the daemon's routes (aiohttp AppKeys)."""

from __future__ import annotations

from aiohttp import web
from localllm.modelstore.store import ModelStore

from localllm.config import Config

from .scheduler import Scheduler

STORE = web.AppKey("store", ModelStore)
SCHEDULER = web.AppKey("scheduler", Scheduler)
CONFIG = web.AppKey("config", Config)
