"""The sidecar web app: a page and an HTTP API over this node's agents and artifacts.

Read-only. It renders artifacts with the same renderers as `dynprof show`, and lists agents
as `dynprof ps` does. It binds to loopback unless told otherwise; on any other address every
request must carry the access token (``Authorization: Bearer TOKEN`` or ``?token=TOKEN``).

    GET /                                   the page: agents, artifacts
    GET /artifact/<id>                      one artifact, rendered
    GET /api/agents                         JSON, as `dynprof ps --json`
    GET /api/artifacts?job=&kind=&limit=    JSON, as `dynprof ls --json`
    GET /api/artifacts/<id>                 JSON manifest and rendered summary
    GET /api/artifacts/<id>/files/<name>    a file of the artifact (only files its manifest lists)
"""

from __future__ import annotations

import hmac
import html
import json
from typing import Any

from flask import Flask, Response, abort, jsonify, request, send_file

from dynprof.cli._common import human_age, human_bytes
from dynprof.cli.ps import agent_rows
from dynprof.cli.show import render, render_html
from dynprof.errors import ArtifactError
from dynprof.registry import list_records
from dynprof.store import Artifact, ArtifactStore

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


def create_app(store: ArtifactStore | None = None, token: str | None = None) -> Flask:
    app = Flask("dynprof")
    store = store or ArtifactStore()

    @app.before_request
    def _check_token() -> None:
        if token is None:
            return
        given = request.args.get("token", "")
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[len("Bearer ") :]
        if not hmac.compare_digest(given.encode(), token.encode()):
            abort(401)

    def _q() -> str:
        return f"?token={html.escape(token)}" if token else ""

    def _get(artifact_id: str) -> Artifact:
        # Only ids under the store's root: never a path from elsewhere on the machine.
        try:
            art = store.get(artifact_id)
        except ArtifactError:
            abort(404)
        if art.root is None or store.root.resolve() not in art.path.resolve().parents:
            abort(404)
        return art

    @app.get("/api/agents")
    def api_agents() -> Response:
        return jsonify({"agents": agent_rows(list_records(), timeout=1.0)})

    @app.get("/api/artifacts")
    def api_artifacts() -> Response:
        arts = store.list(job=request.args.get("job") or None, kind=request.args.get("kind") or None)
        limit = request.args.get("limit", type=int)
        if limit:
            arts = arts[:limit]
        return jsonify({"root": str(store.root), "artifacts": [_artifact_json(a) for a in arts]})

    @app.get("/api/artifacts/<path:artifact_id>/files/<name>")
    def api_file(artifact_id: str, name: str) -> Response:
        art = _get(artifact_id)
        if name not in {f["name"] for f in art.manifest.get("files", [])}:
            abort(404)
        return send_file(art.path / name, as_attachment=True, download_name=name)

    @app.get("/api/artifacts/<path:artifact_id>")
    def api_artifact(artifact_id: str) -> Response:
        art = _get(artifact_id)
        summary, text = render(art)
        return jsonify({"id": art.id, "manifest": art.manifest, "contents": summary, "text": text})

    @app.get("/")
    def index() -> str:
        agents = agent_rows(list_records(), timeout=0.5)
        arts = store.list()[:200]
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
                f"<tr><td><a href='/artifact/{html.escape(a.id)}{_q()}'>{html.escape(a.id)}</a></td>"
                f"<td>{html.escape(a.kind)}</td><td class='{html.escape(a.status)}'>{html.escape(a.status)}</td>"
                f"<td>{html.escape(a.created_at)}</td><td>{human_bytes(a.size)}</td></tr>"
                for a in arts
            )
            or "<tr><td colspan=5>no artifacts yet</td></tr>"
        )
        return (
            f"<!doctype html><html><head><meta charset=utf-8><title>dynprof</title><style>{_STYLE}</style></head>"
            f"<body><h1>dynprof</h1><h2>Agents</h2><table><tr><th>PID</th><th>RANK</th><th>JOB</th><th>STEP</th>"
            f"<th>STATE</th><th>AGE</th><th>COMMAND</th></tr>{rows_agents}</table>"
            f"<h2>Artifacts</h2><p>store: <code>{html.escape(str(store.root))}</code></p>"
            f"<table><tr><th>ID</th><th>KIND</th><th>STATUS</th><th>CREATED</th><th>SIZE</th></tr>{rows_arts}</table>"
            f"</body></html>"
        )

    @app.get("/artifact/<path:artifact_id>")
    def artifact_page(artifact_id: str) -> str:
        art = _get(artifact_id)
        _, text = render(art)
        m = art.manifest
        files = "".join(
            f"<tr><td><a href='/api/artifacts/{html.escape(art.id)}/files/{html.escape(f['name'])}{_q()}'>"
            f"{html.escape(f['name'])}</a></td><td>{human_bytes(f['size'])}</td><td><code>{f['sha256']}</code></td></tr>"
            for f in m.get("files", [])
        )
        fields = "".join(
            f"<tr><th>{k}</th><td>{html.escape(_value(m.get(k)))}</td></tr>"
            for k in ("kind", "status", "job", "host", "rank", "pid", "created_at", "finished_at", "options", "error")
        )
        return (
            f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(art.id)}</title>"
            f"<style>{_STYLE}</style></head><body><p><a href='/{_q()}'>&larr; dynprof</a></p>"
            f"<h1>{html.escape(art.kind)} <small>{html.escape(art.id)}</small></h1><table>{fields}</table>"
            f"<h2>Files</h2><table><tr><th>name</th><th>size</th><th>sha256</th></tr>{files}</table>"
            f"{render_html(art)}"
            f"<h2>Contents</h2><pre>{html.escape(text or '(no summary for this kind)')}</pre></body></html>"
        )

    return app
