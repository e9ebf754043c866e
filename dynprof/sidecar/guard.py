"""What the sidecar checks of every request before it answers: the Host header (DNS rebinding)
and the Origin (cross-site requests), the token kept out of the request log, the refusals
logged at a bounded rate, and an action's body read as strict, bounded JSON."""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO
from urllib.parse import urlsplit

from dynprof import safetext
from dynprof.sidecar.actions import ActionError

MAX_JSON_DEPTH = 16
REFUSAL_LOG_BURST = 20
REFUSAL_LOG_WINDOW_S = 10.0
_TOKEN_IN_URL = re.compile(r"([?&]token=)[^&\s\"]*")


def _strip_port(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8787
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def allowed_hosts(bound: str) -> set[str]:
    """Names a Host header may carry for a server bound to ``bound`` (besides IP literals)."""
    names = {"localhost", "localhost.localdomain", "ip6-localhost", _strip_port(bound)}
    try:
        unspecified = ipaddress.ip_address(_strip_port(bound)).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:  # bound to every address: this machine's own names too, short and long
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                names.add(name.lower())
                names.add(name.lower().split(".", 1)[0])
    return names


def host_is_allowed(host_header: str, bound: str, names: Iterable[str]) -> bool:
    """A Host header is allowed when it names the bound host, a loopback name, one of
    ``names``, or is an IP literal that is loopback, the bound address, or any address when
    bound to all. A DNS name an attacker controls (DNS rebinding) is none of these."""
    host = _strip_port(host_header)
    if not host:
        return False
    if host in names:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    try:
        bound_ip = ipaddress.ip_address(_strip_port(bound))
    except ValueError:
        return False
    return bound_ip.is_unspecified or ip == bound_ip


_DEFAULT_PORTS = {"http": 80, "https": 443}


def same_origin(origin: str, host_header: str, scheme: str) -> bool:
    """Whether an ``Origin`` header names this server as the client reached it: the same
    scheme, host and port as ``scheme``://``host_header`` (a default port written or not).
    A page of another server on this machine (another port) is another origin."""
    o = urlsplit(origin)
    h = urlsplit(f"//{host_header}")
    try:
        o_port, h_port = o.port, h.port
    except ValueError:  # a port that is not one
        return False
    default = _DEFAULT_PORTS.get(scheme)
    return (
        o.scheme == scheme
        and bool(o.hostname)
        and o.hostname == h.hostname
        and (o_port or default) == (h_port or default)
        and not (o.path or o.query or o.fragment or o.username or o.password)
    )


class _RedactTokens(logging.Filter):
    """Keep the token out of the request log (``GET /?token=...``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.args = tuple(_TOKEN_IN_URL.sub(r"\1<redacted>", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = _TOKEN_IN_URL.sub(r"\1<redacted>", record.msg)
        return True


class RefusalLog:
    """One stderr line per refused request, without the token (no query string, no headers),
    at most ``burst`` lines per ``window_s`` seconds; what a flood has left out is counted and
    reported in one line when the next window opens."""

    def __init__(
        self, stream: TextIO | None = None, burst: int = REFUSAL_LOG_BURST, window_s: float = REFUSAL_LOG_WINDOW_S
    ) -> None:
        self._stream = stream
        self._burst = burst
        self._window_s = window_s
        self._lock = threading.Lock()
        self._window_start = -math.inf
        self._logged = 0
        self._dropped = 0

    def refused(self, status: int, why: str, method: str, path: str, remote: str | None) -> None:
        where = safetext.one_line(path.split("?", 1)[0], 200)
        self.say(
            f"dynprof serve: refused {status} ({why}): {safetext.one_line(method, 16)} {where} from {remote or '?'}"
        )

    def say(self, line: str) -> None:
        """One line (made printable), under the same rate limit as the refusals."""
        now = time.monotonic()
        lines = []
        with self._lock:
            if now - self._window_start >= self._window_s:
                if self._dropped:
                    lines.append(f"dynprof serve: {self._dropped} more refused request(s) not logged (rate limit)")
                self._window_start, self._logged, self._dropped = now, 0, 0
            if self._logged >= self._burst:
                self._dropped += 1
            else:
                self._logged += 1
                lines.append(safetext.one_line(line, None))
        if lines:
            stream = self._stream or sys.__stderr__ or sys.stderr
            try:
                stream.write("".join(line + "\n" for line in lines))
                stream.flush()
            except (OSError, ValueError):
                pass


class _StrictJSONError(ValueError):
    pass


def parse_action_body(raw: bytes) -> tuple[dict[str, Any], float | None]:
    """(options, timeout) from an action's body: a JSON object with at most ``options`` (an
    object) and ``timeout`` (positive seconds); an empty body is ``{}``. No duplicate keys, no
    NaN or Infinity, at most ``MAX_JSON_DEPTH`` levels. ActionError otherwise."""
    if not raw.strip():
        return {}, None

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise _StrictJSONError(f"duplicate key {k[:40]!r}")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise _StrictJSONError(f"{name} is not JSON")

    if raw.count(b"[") + raw.count(b"{") > 4096 or _depth(raw) > MAX_JSON_DEPTH:
        raise ActionError(f"the body nests more than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except _StrictJSONError as exc:
        raise ActionError(f"bad JSON body: {exc}") from None
    except (ValueError, RecursionError):
        raise ActionError("the body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise ActionError('the body must be a JSON object: {"options": {...}, "timeout": SECONDS}')
    extra = set(body) - {"options", "timeout"}
    if extra:
        raise ActionError(
            f"unknown key(s) in the body: {', '.join(sorted(k[:40] for k in extra))}; known: options, timeout"
        )
    options = body.get("options", {})
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ActionError("options must be a JSON object")
    timeout = body.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0
    ):
        raise ActionError("timeout must be a positive number of seconds")
    return options, (float(timeout) if timeout is not None else None)


def _depth(raw: bytes) -> int:
    """Nesting depth of a JSON text, counted on brackets outside strings (before parsing)."""
    depth = deepest = 0
    in_str = escaped = False
    for b in raw:
        if in_str:
            if escaped:
                escaped = False
            elif b == 0x5C:
                escaped = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest
