"""The sidecar web app: a page and an HTTP API over this node's agents and artifacts.

Read-only. It renders artifacts with the same renderers as `dynprof show`, and lists agents
as `dynprof ps` does. Every request, on every address (loopback included: other users of the
machine can reach loopback too), must carry the access token: ``Authorization: Bearer TOKEN``,
``?token=TOKEN`` (the page then sets an HttpOnly, SameSite=Strict cookie so its links work), or
that cookie. The Host header must name the bound address, a loopback name, this machine's
name or an IP address (DNS rebinding), and a browser's cross-site requests are refused.
Files are served only from inside the artifact's directory, never through a link.

    GET /                                   the page: agents, artifacts
    GET /artifact/<id>                      one artifact, rendered
    GET /api/agents                         JSON, as `dynprof ps --json`
    GET /api/artifacts?job=&kind=&limit=    JSON, as `dynprof ls --json`
    GET /api/artifacts/<id>                 JSON manifest and rendered summary
    GET /api/artifacts/<id>/files/<name>    a file of the artifact (only files its manifest lists)
    GET /api/v1/info                        {"api": 1, "dynprof_version", "host", "actions"}
    POST /api/v1/actions/<name>             {"options": {...}, "timeout": s}: dynprof.actions.run_action
    GET /api/v1/artifacts/<id>[/files/<n>]  as /api/artifacts/...
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, urlsplit

from flask import Flask, Response, abort, jsonify, request, send_file
from werkzeug.exceptions import HTTPException

from dynprof import __version__
from dynprof.actions import ACTIONS, API_VERSION, ActionError, run_action
from dynprof.cli._common import human_age, human_bytes
from dynprof.cli.ps import agent_rows
from dynprof.cli.show import render, render_html
from dynprof.errors import ArtifactError
from dynprof.identity import detect
from dynprof.registry import list_records
from dynprof.store import Artifact, ArtifactStore

COOKIE = "dynprof_token"
MAX_REQUEST_BYTES = 64 * 1024
_TOKEN_IN_URL = re.compile(r"([?&]token=)[^&\s\"]*")

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin-bottom:1.5em}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:1em;overflow:auto}.complete{color:#176f2c}
.partial{color:#9a6700}.failed{color:#b3261e}code{font-size:13px}
"""


def _artifact_json(a: Artifact) -> dict[str, Any]:
    m = a.manifest
    return {
        "id": a.id,
        "kind": a.kind,
        "status": a.status,
        "job": m.get("job"),
        "host": m.get("host"),
        "rank": m.get("rank"),
        "pid": m.get("pid"),
        "created_at": a.created_at,
        "bytes": a.size,
    }


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


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
    if unspecified:  # bound to every address: this machine's own names too
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                names.add(name.lower())
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


class _RedactTokens(logging.Filter):
    """Keep the token out of the request log (``GET /?token=...``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.args = tuple(_TOKEN_IN_URL.sub(r"\1<redacted>", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = _TOKEN_IN_URL.sub(r"\1<redacted>", record.msg)
        return True


def create_app(store: ArtifactStore | None = None, token: str | None = None, host: str = "127.0.0.1") -> Flask:
    """The sidecar's app. ``token`` is required on every request; ``None`` turns the check
    off, which only tests of the page itself do (``dynprof serve`` always sets one)."""
    app = Flask("dynprof")
    app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    store = store or ArtifactStore()
    names = allowed_hosts(host)
    werkzeug_log = logging.getLogger("werkzeug")
    if not any(isinstance(f, _RedactTokens) for f in werkzeug_log.filters):
        werkzeug_log.addFilter(_RedactTokens())

    def _given_token() -> tuple[str, bool]:
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :], False
        if "token" in request.args:
            return request.args.get("token", ""), True
        return request.cookies.get(COOKIE, ""), False

    @app.before_request
    def _check_request() -> None:
        # DNS rebinding: a page from evil.example whose name now points at 127.0.0.1 sends
        # "Host: evil.example".
        if not host_is_allowed(request.host, host, names):
            abort(400, "unexpected Host header")
        if token is None:
            return
        given, _ = _given_token()
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
            abort(401)
        # A browser's request from another site: never, whatever it carries.
        if request.headers.get("Sec-Fetch-Site", "") == "cross-site":
            abort(403)
        origin = request.headers.get("Origin")
        if origin is not None:
            parsed = urlsplit(origin)
            if (
                origin == "null"
                or not host_is_allowed(parsed.netloc, host, names)
                or (_strip_port(parsed.netloc) != _strip_port(request.host))
            ):
                abort(403)

    @app.after_request
    def _headers(response: Response) -> Response:
        response.headers["Referrer-Policy"] = "no-referrer"  # the token may be in the URL
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Cache-Control"] = "no-store"
        response.headers["Content-Security-Policy"] = "default-src 'none'; style-src 'unsafe-inline'"
        if token is not None and response.status_code < 400:
            given, in_query = _given_token()
            if in_query and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
                response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> tuple[Response, int]:
        code = exc.code or 500
        return jsonify({"error": exc.name, "code": code}), code

    @app.errorhandler(Exception)
    def _bug(exc: Exception) -> tuple[Response, int]:
        app.logger.error("dynprof serve: %s on %s: %s", type(exc).__name__, request.path[:200], exc)
        return jsonify({"error": "internal error", "code": 500}), 500

    def _get(artifact_id: str) -> Artifact:
        # Only ids under the store's root: never a path from elsewhere on the machine.
        try:
            return store.get(artifact_id, inside_only=True)
        except ArtifactError:
            abort(404)

    @app.get("/api/agents")
    def api_agents() -> Response:
        return jsonify({"agents": agent_rows(list_records(), timeout=1.0)})

    @app.get("/api/artifacts")
    def api_artifacts() -> Response:
        arts, bad = store.scan(job=request.args.get("job") or None, kind=request.args.get("kind") or None)
        limit = request.args.get("limit", type=int)
        if limit and limit > 0:
            arts = arts[:limit]
        return jsonify(
            {
                "root": str(store.root),
                "artifacts": [_artifact_json(a) for a in arts],
                "bad": [{"id": b.id, "reason": b.reason} for b in bad],
            }
        )

    @app.get("/api/artifacts/<path:artifact_id>/files/<name>")
    def api_file(artifact_id: str, name: str) -> Response:
        art = _get(artifact_id)
        if name not in {f["name"] for f in art.files}:
            abort(404)
        try:
            fh = art.open(name)  # inside the artifact's directory, never through a link
        except ArtifactError:
            abort(404)
        return send_file(fh, as_attachment=True, download_name=name, mimetype="application/octet-stream")

    @app.get("/api/artifacts/<path:artifact_id>")
    def api_artifact(artifact_id: str) -> Response:
        art = _get(artifact_id)
        summary, text = render(art)
        return jsonify({"id": art.id, "manifest": art.manifest, "contents": summary, "text": text})

    app.add_url_rule("/api/v1/artifacts/<path:artifact_id>/files/<name>", "api_v1_file", api_file)
    app.add_url_rule("/api/v1/artifacts/<path:artifact_id>", "api_v1_artifact", api_artifact)

    @app.get("/api/v1/info")
    def api_v1_info() -> Response:
        return jsonify(
            {"api": API_VERSION, "dynprof_version": __version__, "host": detect().host, "actions": sorted(ACTIONS)}
        )

    @app.post("/api/v1/actions/<name>")
    def api_v1_action(name: str) -> tuple[Response, int]:
        body = request.get_json(silent=True)
        timeout = body.get("timeout") if isinstance(body, dict) else None
        if not isinstance(body, dict) or (
            timeout is not None
            and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400)
        ):
            return jsonify({"error": 'the body must be {"options": {...}, "timeout": seconds}', "code": 400}), 400
        try:
            return jsonify(run_action(name, body.get("options") or {}, timeout)), 200
        except ActionError as exc:
            return jsonify({"error": str(exc), "code": 400}), 400

    @app.get("/")
    def index() -> str:
        agents = agent_rows(list_records(), timeout=0.5)
        arts, bad = store.scan()
        arts = arts[:200]
        rows_agents = (
            "".join(
                f"<tr><td>{a['pid']}</td><td>{a['rank'] if a['rank'] is not None else '-'}</td>"
                f"<td>{html.escape(str(a['job'] or '-'))}</td><td>{a.get('step') if a.get('step') is not None else '-'}</td>"
                f"<td>{html.escape(a['state'])}</td><td>{human_age(a['age_s'])}</td>"
                f"<td><code>{html.escape(' '.join(a['cmdline'])[:100])}</code></td></tr>"
                for a in agents
            )
            or "<tr><td colspan=7>no agents on this node</td></tr>"
        )
        rows_arts = (
            "".join(
                f"<tr><td><a href='/artifact/{html.escape(quote(a.id))}'>{html.escape(a.id)}</a></td>"
                f"<td>{html.escape(a.kind)}</td><td class='{html.escape(a.status)}'>{html.escape(a.status)}</td>"
                f"<td>{html.escape(a.created_at)}</td><td>{human_bytes(a.size)}</td></tr>"
                for a in arts
            )
            or "<tr><td colspan=5>no artifacts yet</td></tr>"
        )
        rows_bad = "".join(
            f"<tr><td>{html.escape(b.id)}</td><td class='failed'>bad</td><td>{html.escape(b.reason)}</td></tr>"
            for b in bad[:200]
        )
        if rows_bad:
            rows_bad = f"<h2>Damaged (skipped)</h2><table><tr><th>ID</th><th></th><th>WHY</th></tr>{rows_bad}</table>"
        return (
            f"<!doctype html><html><head><meta charset=utf-8><title>dynprof</title><style>{_STYLE}</style></head>"
            f"<body><h1>dynprof</h1><h2>Agents</h2><table><tr><th>PID</th><th>RANK</th><th>JOB</th><th>STEP</th>"
            f"<th>STATE</th><th>AGE</th><th>COMMAND</th></tr>{rows_agents}</table>"
            f"<h2>Artifacts</h2><p>store: <code>{html.escape(str(store.root))}</code></p>"
            f"<table><tr><th>ID</th><th>KIND</th><th>STATUS</th><th>CREATED</th><th>SIZE</th></tr>{rows_arts}</table>"
            f"{rows_bad}</body></html>"
        )

    @app.get("/artifact/<path:artifact_id>")
    def artifact_page(artifact_id: str) -> str:
        art = _get(artifact_id)
        _, text = render(art)
        m = art.manifest
        files = "".join(
            f"<tr><td><a href='/api/artifacts/{html.escape(quote(art.id))}/files/{html.escape(quote(f['name']))}'>"
            f"{html.escape(f['name'])}</a></td><td>{human_bytes(f['size'])}</td><td><code>{html.escape(f['sha256'])}</code></td></tr>"
            for f in art.files
        )
        fields = "".join(
            f"<tr><th>{k}</th><td>{html.escape(_value(m.get(k)))}</td></tr>"
            for k in ("kind", "status", "job", "host", "rank", "pid", "created_at", "finished_at", "options", "error")
        )
        return (
            f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(art.id)}</title>"
            f"<style>{_STYLE}</style></head><body><p><a href='/'>&larr; dynprof</a></p>"
            f"<h1>{html.escape(art.kind)} <small>{html.escape(art.id)}</small></h1><table>{fields}</table>"
            f"<h2>Files</h2><table><tr><th>name</th><th>size</th><th>sha256</th></tr>{files}</table>"
            f"{render_html(art)}"
            f"<h2>Contents</h2><pre>{html.escape(text or '(no summary for this kind)')}</pre></body></html>"
        )

    return app
