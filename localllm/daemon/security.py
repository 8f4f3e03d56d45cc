"""Who may talk to the daemon: the Host check, CORS for listed origins, and the API key.

- Host (TCP only): a web page on an attacker's domain can re-point that domain at 127.0.0.1
  (DNS rebinding) and then read our answers as same-origin. Its requests still carry the
  attacker's name in `Host`, so only localhost names, the address we are bound to and the hosts
  the user lists (`allowed_hosts`) pass; anything else is a 403. An IP literal cannot be
  rebound, so any IP passes when we listen on every address (0.0.0.0 or ::).
- Origin: a browser sends `Origin` on every cross-origin request. Origins the user lists in
  `origins` (localhost origins always) get CORS headers and preflight answers; any other origin
  is refused with 403 before a handler runs, so a page cannot make us pull, delete or generate
  even where it could not read the answer (a "simple" POST needs no preflight).
- Other users (TCP only): on a shared machine anyone can reach 127.0.0.1. A loopback
  connection from another uid (Linux: read from the kernel's socket table, below) gets
  a 403 unless it carries the API key; where the uid cannot be told, `shared_machine = true`
  asks every TCP request for the key. A connection whose owner cannot be found on Linux is
  treated as another user's.
- API key (TCP only, when one is set; a non-loopback bind needs one): every route but
  /api/version wants `Authorization: Bearer <key>`. Preflights carry no credentials, so they
  are answered before the key is checked.
The Unix socket is guarded by its file mode (0600 in a 0700 dir) and skips the Host and key
checks.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import socket
import sys
import weakref
from pathlib import Path

from aiohttp import web

from localllm import paths
from localllm.config import Config
from localllm.modelstore.store import StoreError, shown_path

from .http_errors import error_body

LOCAL_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")
ALLOWED_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = ("Authorization, Content-Type, Accept, User-Agent, X-Requested-With, X-Api-Key, "
                   "Anthropic-Version, Anthropic-Beta")
OPEN_PATHS = frozenset({"/api/version"})


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated setting as its entries (blank ones dropped)."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def is_unix(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def _json_error(request: web.Request, status: int, message: str) -> web.Response:
    return web.json_response(error_body(request.path, status, message), status=status)


# ---- Host ----------------------------------------------------------------------------------
def host_name(header: str) -> str:
    """`Host` without its port, lower case: `[::1]:80` -> `::1`, `A.com:1` -> `a.com`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        return header.partition(":")[0]
    return header


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_allowed(header: str, bound: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's Host names this daemon rather than someone else's domain (pure)."""
    name = host_name(header).rstrip(".")
    if not name or name == "localhost" or name.endswith(".localhost"):
        return True
    ip = _ip(name)
    bound_ip = _ip(bound)
    if ip is not None and (ip.is_loopback or (bound_ip is not None and bound_ip.is_unspecified)):
        return True
    if name == bound.lower() or (ip is not None and ip == bound_ip):
        return True
    return any(wildcard(pattern, name) for pattern in allowed)


def host_middleware(config: Config):
    bound, _ = config.tcp
    allowed = split_list(config.allowed_hosts)

    @web.middleware
    async def check_host(request: web.Request, handler):
        if not is_unix(request) and not host_allowed(request.headers.get("Host", ""), bound,
                                                     allowed):
            return _json_error(request, 403, f"host {request.host!r} is not allowed: add it to "
                               "allowed_hosts (LOCALLLM_ALLOWED_HOSTS) to reach localllm by "
                               "that name")
        return await handler(request)
    return check_host


# ---- Origin / CORS -----------------------------------------------------------------------
def wildcard(pattern: str, text: str) -> bool:
    """`*` matches any run of characters; everything else literally, case ignored."""
    regex = ".*".join(re.escape(part) for part in pattern.lower().split("*"))
    return re.fullmatch(regex, text.lower()) is not None


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Localhost origins (any port) and the user's list; `*` wildcards as in OLLAMA_ORIGINS."""
    origin = origin.strip()
    return bool(LOCAL_ORIGIN.match(origin.lower())) or any(wildcard(p, origin) for p in allowed)


def cors_middleware(config: Config):
    allowed = split_list(config.origins)

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)  # not a browser's cross-origin request
        if not origin_allowed(origin, allowed):
            return _json_error(request, 403, f"origin {origin!r} is not allowed: add it to "
                               "origins (LOCALLLM_ORIGINS) to call localllm from that page")
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return _preflight(request, origin)
        return await handler(request)  # CORS headers are added in on_response_prepare
    return cors


def _preflight(request: web.Request, origin: str) -> web.Response:
    method = request.headers["Access-Control-Request-Method"].upper()
    if method not in ALLOWED_METHODS.split(", "):
        return _json_error(request, 405, f"method {method} is not allowed")
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": ALLOWED_METHODS,
        "Access-Control-Allow-Headers": asked or ALLOWED_HEADERS,
        "Access-Control-Max-Age": "600",
        "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    }
    return web.Response(status=204, headers=headers)


def cors_headers(config: Config):
    """An on_response_prepare hook: every answer to an allowed origin, streams included (their
    headers go out when the handler prepares them, after any middleware could add them),
    carries the CORS headers."""
    allowed = split_list(config.origins)

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and origin_allowed(origin, allowed) \
                and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
    return add


# ---- other users ---------------------------------------------------------------------------
def _sent_keys(request: web.Request) -> list[bytes]:
    # Anthropic's clients send the key as x-api-key: every route takes either header.
    sent = [request.headers.get("Authorization", "").encode("utf-8", "replace")]
    if "x-api-key" in request.headers:
        sent.append(f"Bearer {request.headers['x-api-key']}".encode("utf-8", "replace"))
    return sent


def key_matches(request: web.Request, api_key: str) -> bool:
    expected = f"Bearer {api_key}".encode()
    return bool(api_key) and any([hmac.compare_digest(sent, expected)
                                  for sent in _sent_keys(request)])


# The kernel lists every TCP socket of this network namespace in /proc/net/tcp and
# /proc/net/tcp6, with the uid that owns it. The client's end of a connection to us is the entry
# whose local address is the peer address we see and whose remote address is ours; its uid is
# the client's. Elsewhere there is no such table, and `peer_uid` answers None.
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def parse_address(text: str) -> Address:
    """`0100007F:1F90` (the kernel's hex: 32-bit words in host byte order, port big-endian)."""
    host, _, port = text.partition(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is printed as a native integer: on a little-endian host, reversed bytes.
    order = sys.byteorder
    packed = b"".join(int.from_bytes(raw[i:i + 4], order).to_bytes(4, "big")
                      for i in range(0, len(raw), 4))
    ip = ipaddress.IPv4Address(packed) if len(packed) == 4 else ipaddress.IPv6Address(packed)
    return ip, int(port, 16)


def plain_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address):
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def find_uid(table_text: str, peer: Address, ours: Address) -> int | None:
    """The uid of the established socket whose local end is `peer` and remote end `ours`
    (pure: the text of one /proc/net/tcp* file)."""
    want_peer = (plain_ip(peer[0]), peer[1])
    want_ours = (plain_ip(ours[0]), ours[1])
    for line in table_text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[3] != ESTABLISHED:
            continue
        try:
            local, remote = parse_address(fields[1]), parse_address(fields[2])
            uid = int(fields[7])
        except ValueError:
            continue
        if ((plain_ip(local[0]), local[1]) == want_peer
                and (plain_ip(remote[0]), remote[1]) == want_ours):
            return uid
    return None


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of a loopback TCP connection, or None when it cannot be
    told (not Linux, not loopback, or the connection is already gone)."""
    try:
        peer_host, peer_port = sock.getpeername()[:2]
        our_host, our_port = sock.getsockname()[:2]
        peer = (ipaddress.ip_address(peer_host.partition("%")[0]), peer_port)
        ours = (ipaddress.ip_address(our_host.partition("%")[0]), our_port)
    except (OSError, ValueError):
        return None
    if not plain_ip(peer[0]).is_loopback:
        return None
    for table in TABLES:
        try:
            text = table.read_text()
        except OSError:
            continue
        uid = find_uid(text, peer, ours)
        if uid is not None:
            return uid
    return None


def owner_middleware(config: Config, lookup=peer_uid, platform: str = sys.platform):
    """403 for a TCP request from another local user that does not carry the API key."""
    me = os.getuid()
    known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport -> uid

    def uid_of(request: web.Request) -> int | None:
        transport = request.transport
        if transport is None:
            return None
        if transport not in known:
            sock = transport.get_extra_info("socket")
            known[transport] = lookup(sock) if sock is not None else None
        return known[transport]

    def foreign(request: web.Request) -> tuple[bool, str]:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        host = peer[0] if peer else ""
        ip = _ip(str(host).partition("%")[0])
        if ip is not None and not plain_ip(ip).is_loopback:
            return False, ""  # off this machine: the API key (required there) decides
        uid = uid_of(request)
        if uid is not None:
            return uid != me, f"uid {uid}"
        if platform.startswith("linux"):
            return True, "a user this daemon cannot identify"  # fail closed
        return config.shared_machine, "another user (shared_machine is on)"

    @web.middleware
    async def check_owner(request: web.Request, handler):
        if is_unix(request) or request.path in OPEN_PATHS:
            return await handler(request)
        other, who = foreign(request)
        if other and not key_matches(request, config.api_key):
            hint = ("send 'Authorization: Bearer <key>' with the owner's API key"
                    if config.api_key else "the owner has set no API key (api_key), so only "
                    "they can use it")
            return _json_error(request, 403, f"this localllm belongs to another user and {who} "
                               f"is not its owner: {hint}")
        return await handler(request)
    return check_owner


# ---- API key -------------------------------------------------------------------------------
def key_middleware(api_key: str):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if api_key and not is_unix(request) and request.path not in OPEN_PATHS \
                and not key_matches(request, api_key):
            return _json_error(request, 401, "missing or wrong API key: send "
                               "'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        return await handler(request)
    return check_key


def check_bind(config: Config) -> None:
    """A bind other than loopback needs an API key (raises UserError otherwise)."""
    from localllm.errors import UserError

    host, _ = config.tcp
    if not paths.is_loopback(host) and not config.api_key:
        raise UserError(f"refusing to listen on {host} without an API key: set api_key in "
                        f"config.toml or LOCALLLM_API_KEY, or bind 127.0.0.1")


# ---- files a TCP client may name ----------------------------------------------------------
def import_source(request: web.Request, text: str, roots: tuple[Path, ...]) -> Path:
    """The file a request names for /api/import or `FROM /path`, checked. Over TCP it must be
    a file under one of `roots` (import_dirs); one outside them gets the same answer as one
    that does not exist, so the route cannot tell a client which of the owner's paths exist.
    Over the Unix socket (only the owner can open it) any path passes. Blocking (stat)."""
    path = Path(text).expanduser()
    if is_unix(request):
        return path
    try:  # symlinks and `..` first: the file actually read must be inside
        resolved = path.resolve()
        found = any(resolved.is_relative_to(root) for root in roots) and resolved.is_file()
    except OSError:  # a name too long, a loop of links: not a file either
        found = False
    if not found:
        raise StoreError(f"{shown_path(text)}: no such file in the folders a TCP client may "
                         f"import from "
                         f"(import_dirs: {', '.join(map(str, roots))}); over the Unix socket "
                         "any of your files can be imported")
    return resolved
