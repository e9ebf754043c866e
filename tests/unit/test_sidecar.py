"""The sidecar web app: page, API, token, and no access outside the store."""

from __future__ import annotations

import pytest

from dynprof.cli.serve import _is_loopback
from dynprof.sidecar import create_app
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
    assert client.get("/api/artifacts?token=wrong").status_code == 401
    assert client.get("/api/artifacts?token=s3cret").status_code == 200
    assert client.get("/api/artifacts", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_loopback_detection():
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.0.0.5")


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
