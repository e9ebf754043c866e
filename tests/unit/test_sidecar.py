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
