"""The daemon: an aiohttp app (Ollama + OpenAI routes) on a Unix socket and on TCP.

`create_app(config)` builds the app (tests call it directly); `serve(config)` binds the sockets
and runs until SIGINT/SIGTERM. The Unix socket is the user's alone (0600 in a 0700 dir); a
non-loopback TCP bind is refused unless an API key is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from pathlib import Path

from aiohttp import web
from localllm.profiles.saved import profiles_dir
from localllm.modelstore.store import ModelNotFound, ModelStore, default_store
from localllm.modelstore.sweep import sweep_store

from localllm import paths
from localllm.config import Config, config_file
from localllm.errors import UserError

from . import security
from .api import (
    anthropic,
    create,
    embed,
    input_tokens,
    ollama,
    ollama_models,
    openai,
    responses,
    responses_compact,
    stats,
)
from .api.common import KNOWN, MAX_BODY_BYTES
from .chat.errors import ContextOverflow
from .config_watch import watch_config, watch_profiles
from .http_errors import OVERLOADED, error_body, is_anthropic, overflow_message
from .logging_setup import ACCESS_LOG, AccessLogger, setup_logging
from .metrics import METRICS, Metrics
from .metrics import routes as metrics_routes
from .scheduler import Scheduler
from .state import CONFIG, SCHEDULER, STORE
from .systemd import listen_fds, notify

log = logging.getLogger("localllm.daemon")


def route_of(request: web.Request) -> str:
    """The route's pattern (`/api/chat`), never the raw path: a scanner's paths would make a
    new series each."""
    route = request.match_info.route
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"


CLIENT_CLOSED = 499  # nginx's status for a request its client closed before the answer ended


def client_gone(request: web.Request) -> bool:
    """Whether the request's client has closed its connection."""
    return request.transport is None or request.transport.is_closing()


@web.middleware
async def cancelled_middleware(request: web.Request, handler):
    """A request whose client left has its access-log line too. With handler_cancellation,
    aiohttp cancels the handler when the connection drops and then logs nothing, so a cancelled
    stream (the runner already stopped for it) was invisible in the log."""
    started = asyncio.get_running_loop().time()
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if client_gone(request):
            agent = request.headers.get("User-Agent", "").split(" ", 1)[0][:60]
            ACCESS_LOG.info("%s %s %d", request.method, request.path, CLIENT_CLOSED, extra={
                "status": CLIENT_CLOSED,
                "ms": round((asyncio.get_running_loop().time() - started) * 1000),
                "client": agent or "-"})
        raise


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Every request counted by route and status for /metrics (daemon/metrics.py), a refused
    one too: the counter is bumped here, with no code of the metrics module on the way."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        request.app[METRICS].requests[(request.method, route_of(request), status)] += 1


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(error_body(request.path, e.status, e.reason), status=e.status)
    except Exception as e:
        if isinstance(e, ConnectionResetError) and client_gone(request):
            # A write found the client gone, a moment before aiohttp cancelled the handler for
            # it (handler_cancellation): the same end as that cancel, not an error of ours. (A
            # reset of another connection, the hub's in a pull, is one while the client waits.)
            raise asyncio.CancelledError from e
        if isinstance(e, UserError):  # the exception carries its own message and status
            status, message = e.status, str(e)
        else:
            log.exception("error serving %s %s", request.method, request.path)
            status, message = 500, f"internal error: {type(e).__name__}: {e}"
        if isinstance(e, ContextOverflow):
            message = overflow_message(request.path, e.tokens, e.n_ctx, message)
        param = getattr(e, "param", None)
        headers = {"Retry-After": "5"} if status == 503 else None
        if status == 503 and is_anthropic(request.path):
            status = OVERLOADED
        code = getattr(e, "code", None) or (
            "model_not_found" if isinstance(e, ModelNotFound) else None)
        return web.json_response(error_body(request.path, status, message, param, code),
                                 status=status, headers=headers)


async def root(request: web.Request) -> web.Response:
    # Clients probe for the exact text Ollama answers (see docs on the API).
    return web.Response(text="Ollama is running")


def create_app(config: Config, store: ModelStore | None = None) -> web.Application:
    # Outermost first: a request its client left logged (aiohttp logs none), every request
    # counted (metrics), who is asking (Host, Origin, which
    # local user) before anything runs, errors turned into JSON around the handlers, and the
    # key checked inside so a 401 has the API's error shape.
    middlewares = [cancelled_middleware, metrics_middleware,
                   security.host_middleware(config), security.cors_middleware(config),
                   security.owner_middleware(config), error_middleware,
                   security.key_middleware(config.api_key)]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app.on_response_prepare.append(security.cors_headers(config))
    app[CONFIG] = config
    app[STORE] = store or default_store()
    app[KNOWN] = {}
    app[SCHEDULER] = Scheduler(app[STORE], config, paths.state_dir() / "logs")
    app[METRICS] = Metrics()
    app[SCHEDULER].on_answer = app[METRICS].answered
    app.add_routes(metrics_routes)
    app.router.add_get("/", root)  # GET and HEAD, as Ollama answers both
    app.add_routes(ollama.routes)
    app.add_routes(ollama_models.routes)
    app.add_routes(openai.routes)
    app.add_routes(anthropic.routes)
    app.add_routes(responses.routes)
    app.add_routes(responses_compact.routes)
    app.add_routes(input_tokens.routes)
    app[responses.STORED] = responses.StoredResponses()
    app.add_routes(stats.routes)
    app.add_routes(embed.routes)
    app.add_routes(create.routes)
    with contextlib.suppress(ImportError):
        from .api import pull

        app.add_routes(pull.routes)

    async def scheduler_ctx(app: web.Application):
        await app[SCHEDULER].start()
        yield
        await app[SCHEDULER].close()

    app.cleanup_ctx.append(scheduler_ctx)
    return app


def prepare_socket_path(path: Path) -> None:
    """Make the socket's dir the user's alone and clear a stale socket from a dead daemon."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.parent.stat().st_uid != os.getuid():
        raise UserError(f"{path.parent} belongs to another user: the socket's folder must be "
                        "yours alone; set another with --socket or LOCALLLM_SOCKET")
    os.chmod(path.parent, 0o700)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listening: a leftover
        else:
            raise UserError(f"another localllm daemon is already listening on {path}")
        finally:
            probe.close()


async def serve(config: Config, ready: asyncio.Event | None = None) -> None:
    security.check_bind(config)
    app = create_app(config)
    await asyncio.to_thread(sweep_store, app[STORE])  # what a kill or an unused upload left
    # handler_cancellation: a client that disconnects cancels its handler, so a non-streamed
    # answer stops generating too (a streamed one notices at its next write).
    runner = web.AppRunner(app, access_log=ACCESS_LOG, access_log_class=AccessLogger,
                           shutdown_timeout=5, handler_cancellation=True)
    await runner.setup()
    sock_path = config.socket_path
    host, port = config.tcp
    inherited = listen_fds()  # socket activation: systemd bound them (localllm.socket)
    for sock in inherited:
        await web.SockSite(runner, sock).start()
    if not inherited:
        port = await _bind_own_sockets(runner, sock_path, host, port)
    log.info("localllm %s listening on %s and http://%s:%d", _version(), sock_path, host, port)
    print(json.dumps({"event": "listening", "socket": str(sock_path), "host": host,
                      "port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watchers = [
        asyncio.create_task(watch_config(config_file(), lambda new: _apply_config(app, new),
                                         log, initial=config)),
        asyncio.create_task(watch_profiles(profiles_dir(), log)),
    ]
    if ready:
        ready.set()
    notify("READY=1")
    try:
        await stop.wait()
    finally:
        notify("STOPPING=1")
        for watcher in watchers:
            watcher.cancel()
        await runner.cleanup()
        if not inherited:  # an inherited socket is systemd's: it must outlive this process
            with contextlib.suppress(FileNotFoundError):
                sock_path.unlink()


def _apply_config(app: web.Application, config: Config) -> None:
    """A changed config.toml, while running (config_watch has checked it and logged the change)."""
    app[SCHEDULER].apply_config(config)
    setup_logging(config)


async def _bind_own_sockets(runner: web.AppRunner, sock_path: Path, host: str, port: int) -> int:
    """Listen on the Unix socket and TCP ourselves (not socket-activated); returns the port."""
    prepare_socket_path(sock_path)
    old_umask = os.umask(0o177)  # the socket is created 0600, with no window where it is wider
    try:
        unix_site = web.UnixSite(runner, str(sock_path))
        await unix_site.start()
    finally:
        os.umask(old_umask)
    os.chmod(sock_path, 0o600)
    try:
        tcp = socket.create_server((host, port), family=_family(host), reuse_port=False)
    except OSError as e:
        await runner.cleanup()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}; is another daemon "
                        f"running? Set another address with --host or LOCALLLM_HOST") from None
    await web.SockSite(runner, tcp).start()
    return tcp.getsockname()[1]  # the real one when 0 asked for any free port


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _version() -> str:
    from localllm import __version__

    return __version__
