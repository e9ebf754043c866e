"""The sidecar web app: a page and an HTTP API over this node's agents, tools and artifacts.

It lists agents as `dynprof ps` does, renders artifacts with the same renderers as `dynprof
show`, and runs actions (:mod:`dynprof.sidecar.actions`: each a row of :data:`dynprof.sidecar.table.ACTIONS`,
the kind's request and its collect, answering with the kind's answer).
Every request, on every address (loopback included: other users of the machine can reach
loopback too), must carry the access token: ``Authorization: Bearer TOKEN``, ``?token=TOKEN``
(the page then sets an HttpOnly, SameSite=Strict cookie so its links work), or that cookie;
only ``GET /healthz`` answers without it, and says nothing but ``ok``. The Host header must
name the bound address, a loopback name, this machine's name or an IP address (DNS
rebinding), and a browser's cross-site requests are refused. An action asked with the cookie
or ``?token=`` (a browser) must also carry the page's CSRF value in ``X-Dynprof-CSRF``.
Files are served only from inside the artifact's directory, never through a link. Refused
requests are logged to stderr, one line each, without the token, at most
``REFUSAL_LOG_BURST`` lines per ``REFUSAL_LOG_WINDOW_S`` seconds. docs/api.md is the reference.

    GET  /healthz                                   "ok" (no token: for readiness probes)
    GET  /                                          the page: live ranks, verdicts, jobs, actions, artifacts
    GET  /artifact/<id>                             one artifact, rendered
    GET  /api/v1/info                               {"api": 1, "dynprof_version", "host", "actions"}
    POST /api/v1/actions/<name>                     {"options": {...}, "timeout": s} -> the action's answer
    GET  /api/v1/agents                             JSON, as `dynprof ps --json`
    GET  /api/v1/artifacts?job=&kind=&limit=        JSON, as `dynprof ls --json`
    GET  /api/v1/artifacts/<id>?manifest=1          JSON manifest and rendered summary (manifest=1: the
                                                     manifest alone)
    GET  /api/v1/artifacts/<id>/files/<name>        a file of the artifact (only files its manifest lists)
    GET  /api/v1/progress?job=&fresh=1              each rank's progress (dynprof.progress document);
                                                     fresh=1: read now, not the last poll
    GET  /metrics                                   Prometheus exposition (docs/metrics.md)

The unversioned ``/api/agents`` and ``/api/artifacts...`` are the same as their ``/api/v1/``
twins.
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from flask import Flask, Response, abort, g, jsonify, request, send_file
from werkzeug.exceptions import ClientDisconnected, HTTPException, MethodNotAllowed

from dynprof import __version__, roles, safetext
from dynprof.errors import ArtifactError
from dynprof.identity import detect
from dynprof.registry import list_records
from dynprof.sidecar.actions import API_VERSION, LINK_TEST, ActionError, ActionsBusy, ActionSlots
from dynprof.sidecar.guard import (
    RefusalLog,
    _RedactTokens,
    _strip_port,
    allowed_hosts,
    host_is_allowed,
    parse_action_body,
    same_origin,
)
from dynprof.sidecar.metrics import CONTENT_TYPE, CaptureCounts, SidecarCollector, exposition, registry_of
from dynprof.sidecar.page import PAGE_JS, PAGE_STYLE, VerdictItem, live_html, verdict_item, verdicts_html
from dynprof.sidecar.policy import FanoutConfig, LinkPolicy
from dynprof.sidecar.progress import ProgressBook
from dynprof.sidecar.table import ACTIONS, Action
from dynprof.store import Artifact, ArtifactStore

if TYPE_CHECKING:
    from dynprof.registry import AgentRecord
    from dynprof.watch.model import WatchGauges
from dynprof.units import human_age, human_bytes
from dynprof.watch.model import VERDICT_KIND, NodeProgress
from dynprof.watch.progress import read_progress

COOKIE = "dynprof_token"
CSRF_HEADER = "X-Dynprof-CSRF"
MAX_REQUEST_BYTES = 64 * 1024
RETRY_AFTER_S = 2

_STYLE = PAGE_STYLE
_CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


@dataclass(frozen=True)
class PageViews:
    """How the page and the listings show agents and artifacts, handed in by ``dynprof serve``
    (the sidecar imports no CLI): ``agent_rows(records, timeout)`` as ``dynprof ps --json``
    lists them, ``render(artifact)`` (summary, text) and ``render_html(artifact)`` as
    ``dynprof show`` renders them."""

    agent_rows: Callable[[list[AgentRecord], float], list[dict[str, Any]]]
    render: Callable[[Artifact], tuple[dict[str, Any] | None, str]]
    render_html: Callable[[Artifact], str]


NO_VIEWS = PageViews(lambda records, timeout: [], lambda artifact: (None, ""), lambda artifact: "")


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


def create_app(
    store: ArtifactStore | None = None,
    token: str | None = None,
    host: str = "127.0.0.1",
    *,
    max_actions: int = 4,
    read_only: bool = False,
    refusals: RefusalLog | None = None,
    run_action: Callable[..., dict[str, Any]] | None = None,
    extra_hosts: Iterable[str] = (),
    fanout: FanoutConfig | None = None,
    links: LinkPolicy | None = None,
    table: Mapping[str, Action] | None = None,
    views: PageViews = NO_VIEWS,
    progress: ProgressBook | None = None,
    watch_gauges: Callable[[], list[WatchGauges]] | None = None,
) -> Flask:
    """The sidecar's app. ``token`` is required on every request but ``/healthz``; ``None``
    turns the check off, which only tests of the page itself do (``dynprof serve`` always sets
    one). At most ``max_actions`` actions run at once; ``read_only`` refuses those that act on
    jobs. ``extra_hosts`` are more names the Host header may carry (DNS aliases of this node).
    ``fanout`` lets actions take ``hosts`` (a job-wide view through the other nodes' sidecars).
    ``links`` lets the ``link-test`` action run, where it allows (without it, it is refused).
    ``table`` the actions it runs (by default every row of :data:`ACTIONS`); ``views`` how agents and
    artifacts are shown (without them, none are listed nor summarised). ``progress`` is the
    node's progress book (``dynprof serve`` starts its poller; without one, ``/api/progress``
    reads on demand and ``/metrics`` reads at most once a second); ``watch_gauges`` what a
    hosted watch exports on ``/metrics``. ``run_action`` replaces :meth:`ActionSlots.run` (tests)."""
    app = Flask("dynprof")
    app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    store = store or ArtifactStore()
    names = allowed_hosts(host) | {_strip_port(h) for h in extra_hosts if h.strip()}
    slots = ActionSlots(max_actions, fanout, table, links)
    runner = run_action or slots.run
    refusals = refusals or RefusalLog()
    book = progress or ProgressBook(detect().host, every_s=0.0)
    metrics_registry = registry_of(SidecarCollector(book, CaptureCounts(store), watch_gauges))
    if progress is not None and progress.every_s > 0:  # the page's live state from the poller's book too

        def page_progress() -> NodeProgress:
            view = book.view()
            if book.fresh(view):
                return book.progress(None, view)
            return read_progress(list_records(), detect().host, None, timeout=0.5)

        app.config.setdefault("DYNPROF_PAGE_PROGRESS", page_progress)
    csrf = secrets.token_urlsafe(32)  # per server; the page carries it, a cross-site page cannot read it
    app.config["DYNPROF_CSRF"] = csrf
    werkzeug_log = logging.getLogger("werkzeug")
    if not any(isinstance(f, _RedactTokens) for f in werkzeug_log.filters):
        werkzeug_log.addFilter(_RedactTokens())

    def _given_token() -> tuple[str, str]:
        """(token, where): where is "header", "query" or "cookie"."""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :], "header"
        if "token" in request.args:
            return request.args.get("token", ""), "query"
        return request.cookies.get(COOKIE, ""), "cookie"

    def _refuse(status: int, why: str, message: str | None = None) -> None:
        refusals.refused(status, why, request.method, request.path, request.remote_addr)
        abort(status, message)

    @app.before_request
    def _check_request() -> None:
        if request.path == "/healthz":
            return  # says "ok" and nothing else: a readiness probe has no token
        # DNS rebinding: a page from evil.example whose name now points at 127.0.0.1 sends
        # "Host: evil.example".
        if not host_is_allowed(request.host, host, names):
            _refuse(400, "unexpected Host header", "unexpected Host header")
        if token is not None:
            given, _ = _given_token()
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
                _refuse(401, "wrong token" if given else "missing token")
        # A browser's request from another site: never, whatever it carries.
        if request.headers.get("Sec-Fetch-Site", "") == "cross-site":
            _refuse(403, "cross-site request")
        origin = request.headers.get("Origin")
        if origin is not None and not (
            host_is_allowed(urlsplit(origin).netloc, host, names) and same_origin(origin, request.host, request.scheme)
        ):
            _refuse(403, "cross-site request")
        rule = request.url_rule
        if rule is not None and rule.endpoint == "api_action":
            if request.method == "OPTIONS":  # no CORS preflight is ever granted: actions are POST only
                raise MethodNotAllowed(valid_methods=["POST"])
            _check_action_body()

    def _check_action_body() -> None:
        """An action's body is JSON by its Content-Type (a cross-site form can only send
        text/plain or a form without asking first), or empty without one; it is read here,
        and a body that does not arrive by the server's deadline is 408."""
        ctype = request.headers.get("Content-Type")
        if ctype is None:
            if request.content_length or "Transfer-Encoding" in request.headers:
                _refuse(415, "body without a Content-Type", "an action's body needs Content-Type: application/json")
        elif request.mimetype != "application/json":
            _refuse(415, "Content-Type is not JSON", "an action's body needs Content-Type: application/json")
        try:
            request.get_data()  # kept for the action (within MAX_CONTENT_LENGTH, else 413)
        except (OSError, ClientDisconnected) as exc:  # werkzeug's, raised while handling the OSError
            if isinstance(exc, TimeoutError) or isinstance(exc.__context__, TimeoutError):  # the server's deadline
                _refuse(408, "body not received in time", "the request's body did not arrive in time")
            _refuse(400, "body cut off", "the request's body was cut off")

    @app.after_request
    def _headers(response: Response) -> Response:
        response.headers["Referrer-Policy"] = "no-referrer"  # the token may be in the URL
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Cache-Control"] = "no-store"
        nonce = g.get("script_nonce")
        response.headers["Content-Security-Policy"] = (
            f"{_CSP}; script-src 'nonce-{nonce}'; connect-src 'self'" if nonce else _CSP
        )
        if token is not None and response.status_code < 400:
            given, where = _given_token()
            if where == "query" and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
                response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> tuple[Response, int]:
        code = exc.code or 500
        response = jsonify({"error": exc.name, "code": code})
        if code == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="dynprof"'
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response, code

    @app.errorhandler(Exception)
    def _bug(exc: Exception) -> tuple[Response, int]:
        app.logger.error("dynprof serve: %s on %s: %s", type(exc).__name__, request.path[:200], exc)
        return jsonify({"error": "internal error", "code": 500}), 500

    def _error(status: int, message: str, **headers: str) -> Response:
        response = jsonify({"error": message, "code": status})
        response.status_code = status
        for k, v in headers.items():
            response.headers[k.replace("_", "-")] = v
        return response

    def _get(artifact_id: str) -> Artifact:
        # Only ids under the store's root: never a path from elsewhere on the machine.
        try:
            return store.get(artifact_id, inside_only=True)
        except ArtifactError:
            abort(404)

    def _allowed_actions() -> list[str]:
        """The actions this sidecar does: none that a read-only one refuses, no link test
        without a link policy (``--no-job-wide``), none outside its table (where given)."""
        return sorted(
            n
            for n, a in ACTIONS.items()
            if not (read_only and a.changes_jobs)
            and not (n == LINK_TEST and links is None)
            and (table is None or n in table)
        )

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok\n", mimetype="text/plain")

    @app.get("/api/v1/info")
    def api_info() -> Response:
        return jsonify(
            {
                "api": API_VERSION,
                "dynprof_version": __version__,
                "host": detect().host,
                "actions": _allowed_actions(),
                "read_only": read_only,
                "max_actions": max_actions,
                "job_wide": fanout is not None,
            }
        )

    @app.post("/api/v1/actions/<name>")
    def api_action(name: str) -> Response:
        _, where = _given_token()
        if token is not None and where != "header":
            # a browser (cookie or ?token=): the page's CSRF value, never the cookie alone
            given = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), csrf.encode()):
                refusals.refused(403, "missing or wrong CSRF value", request.method, request.path, request.remote_addr)
                return _error(403, f"an action from a browser needs the page's {CSRF_HEADER} header")
        action = ACTIONS.get(name)
        if action is None:
            return _error(400, f"unknown action {name[:40]!r}; known: {', '.join(sorted(ACTIONS))}")
        try:
            options, timeout = parse_action_body(request.get_data(cache=False))
        except ActionError as exc:
            return _error(400, str(exc))
        if read_only and action.changes_jobs:
            return _error(403, f"this sidecar is read-only (--read-only): {name} is refused")
        try:
            answer = runner(name, options, timeout)
        except ActionError as exc:
            return _error(400, str(exc))
        except ActionsBusy as exc:
            return _error(429, f"{exc}; retry later", Retry_After=str(RETRY_AFTER_S))
        return jsonify(answer)

    def api_agents() -> Response:
        return jsonify({"agents": views.agent_rows(list_records(), 1.0)})

    def api_artifacts() -> Response:
        try:
            arts, bad = store.scan(job=request.args.get("job") or None, kind=request.args.get("kind") or None)
        except ArtifactError as exc:  # a store dynprof refuses (not its, another user's): say why
            return _error(503, f"{exc.message}. {exc.help}".strip())
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

    def api_file(artifact_id: str, name: str) -> Response:
        art = _get(artifact_id)
        if name not in {f["name"] for f in art.files}:
            abort(404)
        try:
            fh = art.open(name)  # inside the artifact's directory, never through a link
        except ArtifactError:
            abort(404)
        # streamed in blocks by the WSGI server's file wrapper, never read whole
        return send_file(fh, as_attachment=True, download_name=name, mimetype="application/octet-stream")

    def api_progress() -> Response:
        job = request.args.get("job") or None
        if job is not None and len(job) > 200:
            return _error(400, "job: at most 200 characters")
        fresh = request.args.get("fresh", "")
        if fresh not in ("", "0", "1"):
            return _error(400, "fresh: 0 or 1")
        view = book.view()
        if fresh == "1" or not book.fresh(view):
            # read now (a watch's look measures each rank's CPU across its two samples, which
            # the poller's last poll may not span), into the book: at most once a second
            # whatever the clients ask, so none can make the agents answer more often
            view = book.poll_if_stale(book.on_demand_max_age_s)
        return jsonify(book.progress(job, view).to_json())

    @app.get("/metrics")
    def metrics() -> Response:
        if book.every_s <= 0:  # no poller: read now, at most once a second whatever the scrapers
            book.poll_if_stale(book.on_demand_max_age_s)
        return Response(exposition(metrics_registry), content_type=CONTENT_TYPE)

    def api_artifact(artifact_id: str) -> Response:
        art = _get(artifact_id)
        if request.args.get("manifest") == "1":  # what a fetch needs, and no more
            return jsonify({"id": art.id, "manifest": art.manifest})
        summary, text = views.render(art)
        return jsonify({"id": art.id, "manifest": art.manifest, "contents": summary, "text": text})

    for prefix in ("/api", "/api/v1"):
        app.add_url_rule(f"{prefix}/agents", f"agents{prefix}", api_agents, methods=["GET"])
        app.add_url_rule(f"{prefix}/progress", f"progress{prefix}", api_progress, methods=["GET"])
        app.add_url_rule(f"{prefix}/artifacts", f"artifacts{prefix}", api_artifacts, methods=["GET"])
        app.add_url_rule(
            f"{prefix}/artifacts/<path:artifact_id>/files/<name>", f"file{prefix}", api_file, methods=["GET"]
        )
        app.add_url_rule(f"{prefix}/artifacts/<path:artifact_id>", f"artifact{prefix}", api_artifact, methods=["GET"])

    @app.get("/")
    def index() -> str:
        nonce = secrets.token_urlsafe(16)
        g.script_nonce = nonce
        agents = views.agent_rows(list_records(), 0.5)
        try:
            arts, bad = store.scan()
            refused = ""
        except ArtifactError as exc:  # the page still shows the jobs, and why there is no listing
            arts, bad = [], []
            refused = f"<p class='failed'>{html.escape(exc.message)}. {html.escape(exc.help)}</p>"
        arts = arts[:200]
        jobs: dict[str, list[dict[str, Any]]] = {}
        for a in agents:
            jobs.setdefault(str(a["job"]) if a["job"] else "", []).append(a)
        live = live_html(_page_progress(app.config.get("DYNPROF_PAGE_PROGRESS")), book.stall_after)
        verdicts = verdicts_html(_page_verdicts(arts))
        sections = "".join(_job_section(job, rows, read_only, fanout is not None) for job, rows in sorted(jobs.items()))
        if not sections:
            sections = "<p>no agents on this node</p>"
        rows_arts = "".join(_artifact_row(a) for a in arts) or "<tr><td colspan=5>no artifacts yet</td></tr>"
        rows_bad = "".join(
            f"<tr><td>{_text(b.id)}</td><td class='failed'>bad</td><td>{_text(b.reason)}</td></tr>" for b in bad[:200]
        )
        if rows_bad:
            rows_bad = f"<h2>Damaged (skipped)</h2><table><tr><th>ID</th><th></th><th>WHY</th></tr>{rows_bad}</table>"
        mode = " <span class='ro'>read-only</span>" if read_only else ""
        return _shown(
            f"<!doctype html><html><head><meta charset=utf-8><title>dynprof</title>"
            f"<meta name=dynprof-csrf content='{html.escape(csrf)}'>"
            f"<meta name=dynprof-store content='{html.escape(str(store.root))}'>"
            f"<style>{_STYLE}</style></head>"
            f"<body><h1>dynprof <small>{_text(detect().host)}</small>{mode}</h1>"
            f"<h2>Live</h2>{live}<h2>Verdicts</h2>{verdicts}"
            f"<h2>Jobs</h2><div id=jobs>{sections}</div>"
            f"<h2>Artifacts</h2><p>store: <code>{html.escape(str(store.root))}</code></p>{refused}"
            f"<table><thead><tr><th>ID</th><th>KIND</th><th>STATUS</th><th>CREATED</th><th>SIZE</th></tr></thead>"
            f"<tbody id=artifacts>{rows_arts}</tbody></table>"
            f"{rows_bad}<script nonce='{nonce}'>{PAGE_JS}</script></body></html>"
        )

    @app.get("/artifact/<path:artifact_id>")
    def artifact_page(artifact_id: str) -> str:
        art = _get(artifact_id)
        _, text = views.render(art)
        m = art.manifest
        files = "".join(
            f"<tr><td><a href='/api/v1/artifacts/{html.escape(quote(art.id))}/files/{html.escape(quote(f['name']))}'>"
            f"{_text(f['name'])}</a></td><td>{human_bytes(f['size'])}</td><td><code>{html.escape(f['sha256'])}</code></td></tr>"
            for f in art.files
        )
        fields = "".join(
            f"<tr><th>{k}</th><td>{_text(_value(m.get(k)))}</td></tr>"
            for k in ("kind", "status", "job", "host", "rank", "pid", "created_at", "finished_at", "options", "error")
        )
        return _shown(
            f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(art.id)}</title>"
            f"<style>{_STYLE}</style></head><body><p><a href='/'>&larr; dynprof</a></p>"
            f"<h1>{_text(art.kind)} <small>{_text(art.id)}</small></h1><table>{fields}</table>"
            f"<h2>Files</h2><table><tr><th>name</th><th>size</th><th>sha256</th></tr>{files}</table>"
            f"{views.render_html(art)}"
            f"<h2>Contents</h2><pre>{html.escape(safetext.lines(text or '(no summary for this kind)'))}</pre></body></html>"
        )

    return app


def _page_progress(source: Callable[[], NodeProgress] | None) -> NodeProgress:
    """The live state the page shows: from ``source`` (``app.config["DYNPROF_PAGE_PROGRESS"]``:
    the sidecar's cached book of its last poll, where it keeps one), else one read now. A
    source that fails shows no ranks rather than no page."""
    try:
        if source is not None:
            return source()
        return read_progress(list_records(), detect().host, None, timeout=0.5)
    except Exception:
        logging.getLogger("dynprof.sidecar").debug("the page's progress read failed", exc_info=True)
        return NodeProgress(host=detect().host, time=time.time(), poll_every_s=0.0)


def _page_verdicts(arts: list[Artifact]) -> list[VerdictItem]:
    """The newest verdict artifacts of the listing, each with its conclusion (the manifest's
    summary; else the verdict's own file)."""
    items = []
    for a in [a for a in arts if a.kind == VERDICT_KIND][:10]:
        conclusion = None
        summary = a.manifest.get("summary")
        if not (isinstance(summary, dict) and isinstance(summary.get("conclusion"), str)):
            try:
                from dynprof.watch.html import load_verdict

                conclusion = load_verdict(a).conclusion
            except Exception:
                conclusion = "(the verdict cannot be read)"
        items.append(verdict_item(a.id, a.manifest, a.created_at, conclusion))
    return items


def _text(value: object) -> str:
    """What an agent, a node or a file said, for the page: one printable line
    (:func:`dynprof.safetext.one_line`), then escaped for HTML."""
    return html.escape(safetext.one_line(value))


def _shown(page: str) -> str:
    """The whole page, last: whatever a fragment let through (a raw escape character, a
    bidirectional override, a byte that is not UTF-8, which would fail the answer) is shown as
    its escape; the page's own markup holds none of them."""
    return safetext.lines(page, limit=None)


def _artifact_row(a: Artifact) -> str:
    return (
        f"<tr><td><a href='/artifact/{html.escape(quote(a.id))}'>{_text(a.id)}</a></td>"
        f"<td>{_text(a.kind)}</td><td class='{html.escape(a.status)}'>{_text(a.status)}</td>"
        f"<td>{_text(a.created_at)}</td><td>{human_bytes(a.size)}</td></tr>"
    )


def _job_section(job: str, rows: list[dict[str, Any]], read_only: bool, job_wide: bool) -> str:
    """One job: its ranks (host, pid, step, state) and the buttons that act on all of them;
    with ``job_wide``, a field naming the job's other nodes, which the buttons then reach too."""
    rows = sorted(rows, key=lambda a: (a["rank"] is None, a["rank"] or 0, a["pid"]))
    # The buttons act on the job's trainers (dynprof.roles), as `--job` does: never a launcher.
    trainers = [a for a in rows if a.get("role") == roles.TRAINER]
    targets = trainers or [a for a in rows if a.get("role") in (None, roles.OTHER)]
    pids = ",".join(str(a["pid"]) for a in targets)
    title = f"job {_text(job)}" if job else "processes without a job id"
    body = "".join(
        f"<tr data-pid='{a['pid']}'><td>{a['rank'] if a['rank'] is not None else '-'}</td>"
        f"<td class='role'>{_text(a.get('role') or '-')}</td>"
        f"<td>{_text(a.get('host') or '-')}</td>"
        f"<td>{a['pid']}</td><td class='step'>{a.get('step') if a.get('step') is not None else '-'}</td>"
        f"<td class='state'>{_text(a['state'])}</td><td>{human_age(a['age_s'])}</td>"
        f"<td><code>{_text(safetext.one_line(' '.join(a['cmdline']), 100))}</code></td></tr>"
        for a in rows
    )
    disabled = " disabled title='read-only sidecar'" if read_only else ""
    nodes = (
        "<div class=nodes><label>nodes of the job <input class=hosts size=60 "
        "placeholder='this node only; or HOST[:PORT],... (each running dynprof serve)'></label> "
        "<button class=act data-action=ps>Ranks on these nodes</button> "
        "<button class=act data-action=ls>Artifacts on these nodes</button></div>"
        if job_wide and job
        else ""
    )
    return (
        # The job id percent-encoded: the page's script sends it back exactly (the page's last
        # pass, _shown, would turn its raw controls and overrides into escapes it cannot match).
        f"<section class=job data-job='{html.escape(quote(job, safe='', errors='backslashreplace'))}' "
        f"data-pids='{pids}'>"
        f"<h3>{title} <small>{len(rows)} process(es)</small></h3>"
        f"<table><tr><th>RANK</th><th>ROLE</th><th>HOST</th><th>PID</th><th>STEP</th><th>STATE</th><th>AGE</th><th>COMMAND</th></tr>"
        f"{body}</table>{nodes}<div class=acts>"
        f"<label>steps <input class=steps type=number min=1 max=1000000 value=3></label> "
        f"<button class=act data-action=start{disabled}>Trace</button> "
        f"<button class=act data-action=stacks>Take stacks</button> "
        f"<button class=act data-action=memory{disabled}>Memory snapshot</button>"
        f"</div><div class=result></div></section>"
    )
