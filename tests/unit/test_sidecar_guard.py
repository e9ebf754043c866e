"""dynprof/sidecar/guard.py: the Host header and the Origin checked (DNS rebinding, cross-site
requests), the token kept out of the request log, refusals logged at a bounded rate and
escaped, and an action's body read as strict, bounded JSON."""

from __future__ import annotations

import io
import logging

import pytest

from dynprof.sidecar.actions import ActionError
from dynprof.sidecar.guard import (
    MAX_JSON_DEPTH,
    RefusalLog,
    _RedactTokens,
    host_is_allowed,
    parse_action_body,
    same_origin,
)


def test_a_host_header_must_name_the_bound_address_a_loopback_name_or_an_allowed_one():
    assert host_is_allowed("127.0.0.1:8787", "127.0.0.1", set())
    assert host_is_allowed("localhost:8787", "127.0.0.1", {"localhost"})
    assert host_is_allowed("node-3:8787", "0.0.0.0", {"node-3"})
    assert not host_is_allowed("evil.example:8787", "127.0.0.1", {"localhost"})


def test_an_origin_is_the_same_only_with_the_same_scheme_host_and_port():
    assert same_origin("http://node-3:8787", "node-3:8787", "http")
    assert not same_origin("https://node-3:8787", "node-3:8787", "http")
    assert not same_origin("http://node-3:9999", "node-3:8787", "http")
    assert not same_origin("http://evil.example", "node-3:8787", "http")


def test_the_token_is_redacted_from_the_request_log():
    record = logging.LogRecord("werkzeug", logging.INFO, "", 0, '"GET /?token=secret&x=1 HTTP/1.1"', (), None)
    _RedactTokens().filter(record)
    assert "secret" not in record.getMessage() and "token=<redacted>&x=1" in record.getMessage()


def test_an_actions_body_is_strict_bounded_json():
    assert parse_action_body(b"") == ({}, None)
    assert parse_action_body(b'{"options": {"job": "j"}, "timeout": 5}') == ({"job": "j"}, 5.0)
    for bad, said in (
        (b'{"options": {}, "options": {}}', "duplicate key"),
        (b'{"timeout": NaN}', "NaN is not JSON"),
        (b"[1]", "must be a JSON object"),
        (b'{"hosts": []}', "unknown key"),
        (b'{"timeout": 0}', "positive number"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nests more than"),
    ):
        with pytest.raises(ActionError, match=said):
            parse_action_body(bad)


def test_a_flood_of_refusals_is_logged_at_a_bounded_rate():
    out = io.StringIO()
    log = RefusalLog(out, burst=2, window_s=3600)
    for _ in range(5):
        log.refused(401, "wrong token", "GET", "/api/v1/info?token=secret", "127.0.0.1")
    assert len(out.getvalue().splitlines()) == 2 and "secret" not in out.getvalue()
    log._window_start -= 7200
    log.say("next")
    assert "3 more refused request(s) not logged" in out.getvalue()


def test_refusal_log_lines_escape_what_a_client_sent_with_the_one_sanitiser():
    # GIVEN a refused request whose method and path carry a newline, an escape and a bidi override
    out = io.StringIO()
    RefusalLog(out).refused(401, "missing token", "GE\nT", "/x\x1b[31m\u202eevil\nforged line", "127.0.0.1")
    # THEN it is one line, each of them escaped as everywhere else (never a bare "?")
    (line,) = out.getvalue().splitlines()
    assert "\\x1b" in line and "\\u202e" in line and "\\n" in line, line
    assert line.startswith("dynprof serve: refused 401 (missing token): GE\\nT /x"), line
