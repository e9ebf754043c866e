"""The sidecar web app: page, API, token, and no access outside the store."""

from __future__ import annotations

import os

import pytest

from dynprof.sidecar.app import create_app
from dynprof.store import ArtifactStore


@pytest.fixture
def store(tmp_path):
    s = ArtifactStore(tmp_path / "store")
    w = s.create("healthcheck", job="j1", host="h")
    w.write_text("notes.txt", "hello <world>")
    w.finish("complete")
    return s


def test_page_and_api_list_artifacts(store):
    client = create_app(store).test_client()
    (art,) = store.list()
    page = client.get("/")
    assert page.status_code == 200
    assert art.id in page.get_data(as_text=True)
    api = client.get("/api/artifacts?kind=healthcheck").get_json()
    assert [a["id"] for a in api["artifacts"]] == [art.id]
    assert client.get("/api/artifacts?kind=trace").get_json()["artifacts"] == []
    detail = client.get(f"/api/artifacts/{art.id}").get_json()
    assert detail["manifest"]["status"] == "complete"
    page = client.get(f"/artifact/{art.id}").get_data(as_text=True)
    assert "notes.txt" in page


def test_a_fetch_asks_for_the_manifest_alone_and_the_client_bounds_that_answer(store):
    from dynprof.job import client as jc

    client = create_app(store).test_client()
    (art,) = store.list()
    doc = client.get(f"/api/v1/artifacts/{art.id}?manifest=1").get_json()
    assert set(doc) == {"id", "manifest"} and doc["manifest"]["status"] == "complete"
    # what a fetch holds per manifest in flight: far under the 80 MiB of an action's answer
    assert jc.MAX_MANIFEST_ANSWER_BYTES <= 4 << 20 < jc.MAX_ANSWER_BYTES


def test_file_download_only_for_listed_files(store):
    client = create_app(store).test_client()
    (art,) = store.list()
    assert client.get(f"/api/artifacts/{art.id}/files/notes.txt").data == b"hello <world>"
    assert client.get(f"/api/artifacts/{art.id}/files/manifest.json").status_code == 404
    assert client.get(f"/api/artifacts/{art.id}/files/..%2f..%2fetc%2fpasswd").status_code == 404


def test_paths_outside_the_store_are_not_served(store, tmp_path):
    outside = ArtifactStore(tmp_path / "elsewhere")
    other = outside.create("trace", job="x").finish()
    client = create_app(store).test_client()
    assert client.get(f"/api/artifacts/{other.path}", follow_redirects=True).status_code == 404
    relative = "../elsewhere/" + str(other.path.relative_to(outside.root))
    assert (store.root / relative / "manifest.json").exists()
    assert client.get(f"/api/artifacts/{relative}").status_code == 404


def test_token_is_required_when_set(store):
    client = create_app(store, token="s3cret").test_client()
    assert client.get("/api/artifacts").status_code == 401
    assert client.get("/api/v1/info").headers["WWW-Authenticate"] == 'Bearer realm="dynprof"'
    assert client.get("/api/artifacts?token=wrong").status_code == 401
    assert client.get("/api/artifacts?token=s3cret").status_code == 200
    assert client.get("/api/artifacts", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_host_header_must_name_this_server(store):
    # GIVEN a server bound to loopback, with a token
    client = create_app(store, token="t" * 20).test_client()
    auth = {"Authorization": "Bearer " + "t" * 20}
    # THEN loopback names and addresses pass, a DNS name an attacker controls does not
    for host in ("localhost", "127.0.0.1:8787", "[::1]:8787", "127.0.0.2"):
        assert client.get("/api/artifacts", headers={**auth, "Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8787", "127.0.0.1.evil.example", "10.0.0.5", ""):
        assert client.get("/api/artifacts", headers={**auth, "Host": host}).status_code == 400, host


def test_wildcard_bind_allows_this_machines_names_and_any_ip(store):
    import socket

    client = create_app(store, token="t" * 20, host="0.0.0.0").test_client()
    auth = {"Authorization": "Bearer " + "t" * 20}
    for host in (socket.gethostname(), "10.0.0.5:8787", "localhost"):
        assert client.get("/api/artifacts", headers={**auth, "Host": host}).status_code == 200, host
    assert client.get("/api/artifacts", headers={**auth, "Host": "evil.example"}).status_code == 400


def test_cross_site_requests_are_refused(store):
    client = create_app(store, token="t" * 20).test_client()
    auth = {"Authorization": "Bearer " + "t" * 20}
    assert client.get("/api/artifacts", headers={**auth, "Origin": "http://evil.example"}).status_code == 403
    assert client.get("/api/artifacts", headers={**auth, "Origin": "null"}).status_code == 403
    assert client.get("/api/artifacts", headers={**auth, "Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.get("/api/artifacts", headers={**auth, "Origin": "http://localhost"}).status_code == 200


def test_query_token_sets_a_strict_http_only_cookie_that_links_ride_on(store):
    token = "t" * 20
    client = create_app(store, token=token).test_client()
    # WHEN the printed URL is opened
    first = client.get(f"/?token={token}")
    # THEN the page sets the cookie, keeps the token out of its links, and later links work with it
    cookie = first.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "dynprof_token=" in cookie
    assert token not in first.get_data(as_text=True)
    assert first.headers["Referrer-Policy"] == "no-referrer"
    (art,) = store.list()
    assert client.get(f"/artifact/{art.id}").status_code == 200  # the test client keeps cookies
    assert create_app(store, token=token).test_client().get(f"/artifact/{art.id}").status_code == 401


def test_token_file_must_be_private(tmp_path, monkeypatch):
    from dynprof.cli.serve import resolve_token
    from dynprof.errors import PermissionDenied, UsageError

    f = tmp_path / "token"
    f.write_text("a" * 32 + "\n")
    f.chmod(0o600)
    assert resolve_token(None, str(f)) == ("a" * 32, str(f))
    monkeypatch.setenv("DYNPROF_TOKEN_FILE", str(f))
    assert resolve_token(None, None)[0] == "a" * 32
    f.chmod(0o640)
    with pytest.raises(PermissionDenied, match="open to other users"):
        resolve_token(None, str(f))
    f.chmod(0o600)
    f.write_text("short")
    with pytest.raises(UsageError, match="at least 16"):
        resolve_token(None, str(f))
    with pytest.raises(UsageError, match="cannot open"):
        resolve_token(None, str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="not both"):
        resolve_token("b" * 20, str(f))
    monkeypatch.delenv("DYNPROF_TOKEN_FILE")
    generated, source = resolve_token(None, None)
    assert source == "generated" and len(generated) >= 32


# -- actions over HTTP (a stub runner: the real ones are tested in tests/integration) ------------
def _stub_app(store, **kwargs):
    calls = []

    def runner(name, options, timeout):
        from dynprof.sidecar.actions import check_options

        check_options(name, options)  # the same checks as the real runner
        calls.append((name, options, timeout))
        return {"api": 1, "action": name, "exit_code": 0, "result": {"ok": True}, "messages": []}

    app = create_app(store, token="t" * 20, run_action=runner, **kwargs)
    return app, calls


AUTH = {"Authorization": "Bearer " + "t" * 20}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}


def test_action_bodies_are_strict(store):
    app, calls = _stub_app(store)
    client = app.test_client()
    ok = client.post("/api/v1/actions/ps", json={"options": {"job": "j"}, "timeout": 5}, headers=AUTH)
    assert ok.status_code == 200 and ok.get_json()["result"] == {"ok": True}
    assert calls == [("ps", {"job": "j"}, 5.0)]
    assert client.post("/api/v1/actions/ps", data=b"", headers=AUTH).status_code == 200  # no body: no options
    for body in (
        b"[]",
        b"null",
        b"{",
        b'{"options": []}',
        b'{"options": {}, "extra": 1}',
        b'{"timeout": 0}',
        b'{"timeout": "5"}',
        b'{"timeout": Infinity}',
        b'{"options": {"job": "a", "job": "b"}}',
        b'{"options": {"a": ' * 20 + b"1" + b"}" * 21,
        b'{"options": {"bogus": 1}}',
    ):
        r = client.post("/api/v1/actions/ps", data=body, headers=JSON_AUTH)
        assert r.status_code == 400 and r.get_json()["code"] == 400, body
    assert client.post("/api/v1/actions/nope", json={}, headers=AUTH).status_code == 400
    assert client.post("/api/v1/actions/ps", data=b" " * (65 * 1024), headers=JSON_AUTH).status_code == 413


def test_browser_actions_need_the_csrf_value_of_the_page(store):
    app, _ = _stub_app(store)
    client = app.test_client()
    page = client.get("/?token=" + "t" * 20)  # sets the cookie
    csrf = app.config["DYNPROF_CSRF"]
    assert f"content='{csrf}'" in page.get_data(as_text=True)
    assert client.post("/api/v1/actions/ps", json={}).status_code == 403  # the cookie alone
    assert client.post("/api/v1/actions/ps", json={}, headers={"X-Dynprof-CSRF": "x" * len(csrf)}).status_code == 403
    assert client.post("/api/v1/actions/ps", json={}, headers={"X-Dynprof-CSRF": csrf}).status_code == 200
    assert create_app(store, token="t" * 20).config["DYNPROF_CSRF"] != csrf  # per server


def test_page_script_runs_only_under_its_nonce(store):
    client = create_app(store, token="t" * 20).test_client()
    r = client.get("/", headers=AUTH)
    csp = r.headers["Content-Security-Policy"]
    import re

    nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert f"<script nonce='{nonce}'>" in r.get_data(as_text=True)
    assert "src=" not in r.get_data(as_text=True)  # nothing loaded from elsewhere
    again = client.get("/", headers=AUTH).headers["Content-Security-Policy"]
    assert nonce not in again  # a fresh nonce per page
    art = client.get("/api/v1/artifacts", headers=AUTH).headers["Content-Security-Policy"]
    assert "script-src" not in art


def test_read_only_refuses_acting_actions(store):
    app, calls = _stub_app(store, read_only=True)
    client = app.test_client()
    assert client.post("/api/v1/actions/start", json={"options": {"job": "j"}}, headers=AUTH).status_code == 403
    assert client.post("/api/v1/actions/ps", json={}, headers=AUTH).status_code == 200
    info = client.get("/api/v1/info", headers=AUTH).get_json()
    assert info["read_only"] and "start" not in info["actions"] and "stacks" in info["actions"]
    assert [c[0] for c in calls] == ["ps"]


def test_busy_slots_are_429(store):
    from dynprof.sidecar.actions import ActionsBusy

    def busy(name, options, timeout):
        raise ActionsBusy("all 4 action slots are busy")

    client = create_app(store, token="t" * 20, run_action=busy).test_client()
    r = client.post("/api/v1/actions/ps", json={}, headers=AUTH)
    assert r.status_code == 429 and r.headers["Retry-After"] == "2" and r.get_json()["code"] == 429


def test_healthz_needs_no_token_and_says_nothing_else(store):
    client = create_app(store, token="t" * 20).test_client()
    r = client.get("/healthz", headers={"Host": "evil.example"})
    assert r.status_code == 200 and r.data == b"ok\n"
    assert client.get("/api/v1/info").status_code == 401


def test_refusal_log_lines_carry_no_token_and_are_rate_limited(store):
    import io

    from dynprof.sidecar.guard import RefusalLog

    out = io.StringIO()
    log = RefusalLog(out, burst=3, window_s=3600)
    client = create_app(store, token="t" * 20, refusals=log).test_client()
    for _ in range(10):
        client.get("/api/v1/info?token=" + "w" * 20)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all("refused 401 (wrong token): GET /api/v1/info from" in x for x in lines)
    assert "w" * 20 not in out.getvalue()
    # the next window opens with the count of what was left out
    log._window_start -= 7200
    client.get("/api/v1/info")
    assert "7 more refused request(s) not logged" in out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("dynprof serve: refused 401 (missing token)")


def test_aliases_of_this_node_pass_the_host_check(store, monkeypatch):
    import socket

    # GIVEN a node whose host name is long, while the job's node list names it short
    monkeypatch.setattr(socket, "gethostname", lambda: "node-5.cluster.example")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "node-5.cluster.example")
    client = create_app(store, token="t" * 20, host="0.0.0.0", extra_hosts=["gpu-05.alias.example"]).test_client()
    # THEN the short name, the long name and the given alias pass; other names do not
    for host in ("node-5:8787", "node-5.cluster.example", "gpu-05.alias.example:8787"):
        assert client.get("/api/v1/info", headers={**AUTH, "Host": host}).status_code == 200, host
    for host in ("node-6", "evil.example", "node-5.evil.example"):
        assert client.get("/api/v1/info", headers={**AUTH, "Host": host}).status_code == 400, host


def test_job_wide_actions_reach_other_nodes_with_the_sidecars_token_file(store, tmp_path, dynprof_dirs):
    import stat

    from dynprof.cli.serve import _fanout_config
    from dynprof.sidecar.actions import FanoutConfig

    # a token from a file: that file; a generated one: a private file in the run directory
    token_file = tmp_path / "token"
    assert _fanout_config("t" * 20, str(token_file), None) == (FanoutConfig(str(token_file)), None)
    config, own = _fanout_config("g" * 24, "generated", "/ca.pem")
    assert own is not None and config.token_file == own and config.cacert == "/ca.pem"
    assert open(own).read().strip() == "g" * 24 and stat.S_IMODE(os.stat(own).st_mode) == 0o600
    assert os.path.dirname(own) == str(dynprof_dirs["run"])
    # without a fan-out configuration, `hosts` is a 400; with one, info says so
    client = create_app(store, token="t" * 20).test_client()
    r = client.post("/api/v1/actions/ps", json={"options": {"hosts": ["node-1"]}}, headers=AUTH)
    assert r.status_code == 400 and "does not reach other nodes" in r.get_json()["error"]
    assert client.get("/api/v1/info", headers=AUTH).get_json()["job_wide"] is False
    wide = create_app(store, token="t" * 20, fanout=config).test_client()
    assert wide.get("/api/v1/info", headers=AUTH).get_json()["job_wide"] is True


# -- HTTP checks: Origin with its port, OPTIONS, Content-Type of actions ---------------------------
def test_an_origin_on_another_port_of_this_host_is_cross_site(store):
    # GIVEN a sidecar on 127.0.0.1:8787 and a page of another server on the same machine
    client = create_app(store, token="t" * 20).test_client()
    here = {**AUTH, "Host": "127.0.0.1:8787"}
    # WHEN that page's requests arrive THEN they are refused; the sidecar's own page passes
    assert client.get("/api/v1/info", headers={**here, "Origin": "http://127.0.0.1:8080"}).status_code == 403
    assert client.get("/api/v1/info", headers={**here, "Origin": "http://127.0.0.1"}).status_code == 403
    assert client.get("/api/v1/info", headers={**here, "Origin": "https://127.0.0.1:8787"}).status_code == 403
    assert client.get("/api/v1/info", headers={**here, "Origin": "http://127.0.0.1:8787"}).status_code == 200
    # AND default ports are the same whether written or not
    assert (
        client.get("/api/v1/info", headers={**AUTH, "Host": "localhost", "Origin": "http://localhost:80"}).status_code
        == 200
    )
    assert (
        client.get("/api/v1/info", headers={**AUTH, "Host": "localhost:80", "Origin": "http://localhost"}).status_code
        == 200
    )


def test_options_is_405_on_actions(store):
    app, calls = _stub_app(store)
    client = app.test_client()
    # WHEN a client asks OPTIONS (a CORS preflight, or a probe of the methods)
    r = client.open("/api/v1/actions/ps", method="OPTIONS", headers=AUTH)
    # THEN 405 with the one method the path takes, and nothing runs
    assert r.status_code == 405 and r.get_json()["code"] == 405
    assert r.headers["Allow"] == "POST" and calls == []
    # AND without the token it is 401 first
    assert client.open("/api/v1/actions/ps", method="OPTIONS").status_code == 401


def test_action_bodies_must_be_json_by_their_content_type(store):
    app, calls = _stub_app(store)
    client = app.test_client()
    # WHEN an action's body comes as a form, as text, or with no type (what a cross-site form sends)
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        r = client.post("/api/v1/actions/ps", data=b'{"options": {}}', headers={**AUTH, **headers})
        # THEN 415, and nothing runs
        assert r.status_code == 415 and r.get_json()["code"] == 415, headers
    assert (
        client.post("/api/v1/actions/ps", data=b"", headers={**AUTH, "Content-Type": "text/plain"}).status_code == 415
    )
    assert calls == []
    # AND what the page and dynprof's client send is served: application/json (with a charset
    # or not), and an empty body without a type
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = client.post("/api/v1/actions/ps", data=b'{"options": {}}', headers={**AUTH, "Content-Type": ctype})
        assert r.status_code == 200, ctype
    assert client.post("/api/v1/actions/ps", data=b"", headers=AUTH).status_code == 200
    assert len(calls) == 4


def test_a_token_file_that_is_not_utf8_is_refused(tmp_path):
    from dynprof.errors import UsageError
    from dynprof.tokens import read_token_file

    # GIVEN a private token file of 30 bytes that are not UTF-8
    f = tmp_path / "token"
    f.write_bytes(b"\xff" * 30 + b"\n")
    f.chmod(0o600)
    # WHEN it is read THEN it is refused with the reason, never turned into U+FFFD
    with pytest.raises(UsageError, match="not UTF-8") as exc:
        read_token_file(str(f))
    assert exc.value.help


def test_an_action_body_that_does_not_arrive_in_time_is_408(store):
    app, calls = _stub_app(store)

    class Dripping:  # what the server's reader does past its body deadline
        def read(self, size=-1):
            raise TimeoutError("timed out")

    # WHEN the body of an action does not come by the server's deadline
    from werkzeug.test import EnvironBuilder, run_wsgi_app

    environ = EnvironBuilder(path="/api/v1/actions/ps", method="POST", headers=JSON_AUTH).get_environ()
    environ.update({"wsgi.input": Dripping(), "CONTENT_LENGTH": "100"})
    body, status, _ = run_wsgi_app(app, environ, buffered=True)
    r = app.response_class(b"".join(body), status=status, mimetype="application/json")
    # THEN 408, and nothing runs
    assert r.status_code == 408 and r.get_json()["code"] == 408 and calls == []


def test_risky_command_lines_are_warned():
    from dynprof.cli.serve import risk_warnings

    # plain HTTP on every address, IPv4 or IPv6: the token in clear
    for host in ("0.0.0.0", "::"):
        (warning,) = risk_warnings(host, tls=False, token_in_argv=False)
        assert host in warning and "in clear" in warning and "--certfile" in warning
    # with TLS, or on one address (loopback, a management network): nothing to say
    for host, tls in (("0.0.0.0", True), ("::", True), ("127.0.0.1", False), ("10.1.2.3", False), ("node-1", False)):
        assert risk_warnings(host, tls=tls, token_in_argv=False) == [], host
    # the token in argv: every user sees it in ps
    (warning,) = risk_warnings("127.0.0.1", tls=False, token_in_argv=True)
    assert "process list" in warning and "--token-file" in warning


def test_a_sidecar_without_job_wide_refuses_the_link_test_action(store):
    # GIVEN a sidecar app as `serve --no-job-wide` builds it (no fan-out, no link policy)
    client = create_app(store, token="t" * 20).test_client()
    # WHEN a token holder asks it for a link test toward a listener of its choosing
    options = {"rank": 1, "world": 2, "store_host": "127.0.0.9", "store_port": 29999}
    r = client.post("/api/v1/actions/link-test", json={"options": options}, headers=AUTH)
    # THEN it is a 400 that says why, and nothing runs
    assert r.status_code == 400 and "runs no link test" in r.get_json()["error"]
    # AND its info does not offer the action, where a sidecar with a link policy does
    info = client.get("/api/v1/info", headers=AUTH).get_json()
    assert info["job_wide"] is False and "link-test" not in info["actions"] and "stacks" in info["actions"]
    from dynprof.sidecar.actions import FanoutConfig, LinkPolicy

    wide = create_app(
        store, token="t" * 20, fanout=FanoutConfig("/token"), links=LinkPolicy.for_sidecar("127.0.0.1", [])
    )
    assert "link-test" in wide.test_client().get("/api/v1/info", headers=AUTH).get_json()["actions"]


def test_info_lists_only_the_actions_of_its_table(store):
    # GIVEN a sidecar given the rows of two actions only
    from dynprof.sidecar.table import ACTIONS

    given = {n: row for n, row in ACTIONS.items() if n in ("ps", "stacks")}
    client = create_app(store, token="t" * 20, table=given).test_client()
    # WHEN its info is read THEN it offers those two
    assert client.get("/api/v1/info", headers=AUTH).get_json()["actions"] == ["ps", "stacks"]
