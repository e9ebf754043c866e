"""dynprof.cli.serve: `dynprof serve`, the sidecar. Its options and their usage errors (all
before anything is bound), where the token comes from, what it warns about, the URL it prints,
the token file the job-wide actions use, the server it builds, and its stop on a signal (a fake
server); once, the whole command on 127.0.0.1 at an ephemeral port, answered and stopped."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dynprof import errors
from dynprof.cli import main
from dynprof.cli import serve as serve_cli
from dynprof.sidecar import child
from tests._ports import free_port as _free_port

TOKEN = "k" * 24


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynprof serve")
    serve_cli.ServeCommand().prepare_parser(parser)
    return parser.parse_args(list(argv))


# -- options ---------------------------------------------------------------------------------------
def test_the_defaults():
    args = _parse()
    assert (args.host, args.port, args.threads, args.max_actions) == ("127.0.0.1", 8787, 8, 4)
    assert args.max_open_files == serve_cli.WANTED_OPEN_FILES and args.progress_every == 2.0
    assert args.token is None and args.token_file is None and args.read_only is False
    assert args.allow_host == [] and args.allow_peer == [] and args.no_job_wide is False
    assert args.watch is False and args.job is None


def test_repeatable_names_are_collected():
    args = _parse("--allow-host", "alias-1", "--allow-host", "10.0.0.2", "--allow-peer", "node-7")
    assert args.allow_host == ["alias-1", "10.0.0.2"] and args.allow_peer == ["node-7"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "0"],
        ["--port", "65536"],
        ["--port", "http"],
        ["--threads", "0"],
        ["--threads", str(serve_cli.MAX_THREADS + 1)],
        ["--max-actions", str(serve_cli.MAX_ACTIONS + 1)],
        ["--max-open-files", "0"],
        ["--progress-every", "-1"],
        ["--progress-every", "3601"],
        ["--progress-every", "nan"],
        ["--host", "no spaces"],
        ["--host", "a\x1b[2J"],
        ["--allow-host", "-bad-"],
    ],
)
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "said"), [("x", "'x' is not a whole number"), ("9", "9 is not in 1-8"), ("0", "0 is not in 1-8")]
)
def test_a_count_is_a_whole_number_in_its_range(text, said):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        serve_cli._count(1, 8)(text)
    assert str(info.value) == said
    assert serve_cli._count(1, 8)("8") == 8


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--certfile", "/c.pem"], "give --certfile and --keyfile together (TLS needs both)"),
        (["--keyfile", "/k.pem"], "give --certfile and --keyfile together (TLS needs both)"),
        (["--progress-every", "0.1"], "--progress-every 0.1 is below 0.2 s"),
        (["--max-actions", "8"], "--max-actions 8 needs --threads above it (now 8)"),
        (["--threads", "2", "--max-actions", "3"], "--max-actions 3 needs --threads above it (now 2)"),
        (["--job", "j"], "--job goes with --watch"),
        (["--watch"], "--watch needs --job JOB"),
    ],
)
def test_usage_errors_come_before_anything_is_bound(argv, said, capsys, dynprof_dirs):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert f"dynprof: error: {said}" in err
    assert "serving on" not in err
    assert not list(dynprof_dirs["run"].glob("serve-*.token"))


def test_an_open_file_limit_too_low_for_the_threads_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr("dynprof.sidecar.server.raise_open_file_limit", lambda wanted: (20, 20))
    assert main(["serve", "--threads", "8"]) == 2
    err = capsys.readouterr().err
    assert "the open-file limit of this process is 20: too low for --threads 8" in err
    assert "ulimit -n" in err


# -- the token -------------------------------------------------------------------------------------
def test_a_token_on_the_command_line_is_checked_and_named(monkeypatch):
    monkeypatch.setenv("DYNPROF_TOKEN_FILE", "/nonexistent")  # the option wins over the variable
    assert serve_cli.resolve_token(TOKEN, None) == (TOKEN, "--token")


@pytest.mark.parametrize("token", ["short", "k" * 20 + " x", "k" * 20 + "\x1b"])
def test_a_bad_token_on_the_command_line_is_a_usage_error(token):
    with pytest.raises(errors.UsageError) as info:
        serve_cli.resolve_token(token, None)
    assert info.value.message.startswith("--token must be at least")


def test_an_empty_token_file_variable_means_a_generated_token(monkeypatch):
    monkeypatch.setenv("DYNPROF_TOKEN_FILE", "")
    first, source = serve_cli.resolve_token(None, None)
    second, _ = serve_cli.resolve_token(None, None)
    assert source == "generated" and len(first) >= 32 and first != second


def test_a_token_file_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(errors.UsageError) as info:
        serve_cli.resolve_token(None, str(tmp_path))
    assert "is not a regular file" in info.value.message


# -- what it says ----------------------------------------------------------------------------------
def test_both_warnings_at_once():
    warnings = serve_cli.risk_warnings("0.0.0.0", tls=False, token_in_argv=True)
    assert len(warnings) == 2
    assert warnings[0].startswith("--token is visible") and "plain HTTP on every address (0.0.0.0)" in warnings[1]


@pytest.mark.parametrize("host", ["[::]", "::", "0.0.0.0"])
def test_every_address_is_recognised_in_each_spelling(host):
    assert serve_cli._is_unspecified(host)
    assert len(serve_cli.risk_warnings(host, tls=False, token_in_argv=False)) == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "node-1", "10.0.0.1", "::1", "", "[bad"])
def test_other_addresses_are_not_every_address(host):
    assert not serve_cli._is_unspecified(host)


def test_the_url_it_prints():
    assert serve_cli._url("127.0.0.1", 8787, "T") == "http://127.0.0.1:8787/?token=T"
    assert serve_cli._url("::1", 9000, "T", tls=True) == "https://[::1]:9000/?token=T"
    assert serve_cli._url("[::1]", 9000, "T") == "http://[::1]:9000/?token=T"
    assert serve_cli._url("node-1", 1, "T", tls=True) == "https://node-1:1/?token=T"


# -- the job-wide actions' token file --------------------------------------------------------------
@pytest.mark.parametrize("source", ["--token", "generated"])
def test_a_token_without_a_file_is_written_to_a_private_one(source, dynprof_dirs):
    config, own = serve_cli._fanout_config(TOKEN, source, "/ca.pem")
    path = Path(own)
    assert config.token_file == own and config.cacert == "/ca.pem"
    assert path.parent == dynprof_dirs["run"] and path.name == f"serve-{os.getpid()}.token"
    assert path.read_text() == TOKEN + "\n"
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_token_file_is_handed_on_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, own = serve_cli._fanout_config(TOKEN, "tok", None)
    assert own is None and config.token_file == str(tmp_path / "tok") and config.cacert is None


def test_the_private_token_file_is_rewritten_not_followed(dynprof_dirs, tmp_path):
    # a link planted at the file's name is refused, never written through
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    link = dynprof_dirs["run"] / f"serve-{os.getpid()}.token"
    link.symlink_to(target)
    with pytest.raises(OSError):
        serve_cli._fanout_config(TOKEN, "generated", None)
    assert target.read_text() == "keep"


def test_the_page_views_are_ps_and_shows_own():
    from dynprof.agents import agent_rows
    from dynprof.renderers import render, render_html

    views = serve_cli.page_views()
    assert (views.agent_rows, views.render, views.render_html) == (agent_rows, render, render_html)


# -- the server ------------------------------------------------------------------------------------
def _hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_the_server_is_bounded_as_configured():
    from dynprof.sidecar.app import MAX_REQUEST_BYTES
    from dynprof.sidecar.server import connection_cap

    server = serve_cli.build_server(_hello, "127.0.0.1", 1, 6, None, None)
    assert server.max_request_body_size == MAX_REQUEST_BYTES
    assert server.max_request_header_size == serve_cli.MAX_HEADER_BYTES
    assert server.requests.min == 6 and server.ssl_adapter is None
    assert server.max_connections == connection_cap(6)


def test_a_certificate_it_cannot_use_is_a_usage_error(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("not a certificate")
    with pytest.raises(errors.UsageError) as info:
        serve_cli.build_server(_hello, "127.0.0.1", 1, 2, str(cert), str(tmp_path / "missing.pem"))
    assert info.value.message.startswith(f"cannot use the certificate {cert} with the key")
    assert "PEM certificate" in (info.value.help or "")


class FakeServer:
    def __init__(self, serve=None) -> None:
        self.stopped = threading.Event()
        self._serve = serve

    def serve(self) -> None:
        if self._serve is not None:
            self._serve(self)
        self.stopped.wait(60)

    def stop(self) -> None:
        self.stopped.set()


@pytest.fixture
def no_children(monkeypatch):
    killed = []
    monkeypatch.setattr(child, "kill_children", lambda: killed.append(True) or 0)
    return killed


def test_a_signal_stops_the_server_and_the_handlers_are_restored(no_children, capsys):
    before = signal.getsignal(signal.SIGTERM)
    server = FakeServer(serve=lambda s: os.kill(os.getpid(), signal.SIGTERM))
    assert serve_cli._serve_until_signalled(server) == 0
    assert server.stopped.is_set() and no_children == [True]
    assert signal.getsignal(signal.SIGTERM) == before
    assert capsys.readouterr().err == "dynprof: stopped serving\n"


def test_a_server_that_fails_is_an_error_after_the_stop(no_children, capsys):
    def boom(s):
        raise OSError("accept failed")

    with pytest.raises(errors.DynprofError) as info:
        serve_cli._serve_until_signalled(FakeServer(serve=boom))
    assert info.value.message == "the HTTP server failed: OSError: accept failed"
    assert no_children == [True] and "stopped serving" in capsys.readouterr().err


def test_a_server_that_ends_by_itself_ends_the_command(no_children):
    server = FakeServer(serve=lambda s: s.stop())
    assert serve_cli._serve_until_signalled(server) == 0


# -- the command, on 127.0.0.1 ---------------------------------------------------------------------


def test_a_port_in_use_is_said(capsys, monkeypatch):
    monkeypatch.setattr(child, "_closing", False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--progress-every", "0", "--no-job-wide"]) == 1
    err = capsys.readouterr().err
    assert f"dynprof: error: cannot listen on 127.0.0.1:{port}" in err and "Choose another --port." in err
    assert "serving on" not in err


def test_a_serve_that_cannot_bind_leaves_no_token_file(capsys, monkeypatch, dynprof_dirs):
    monkeypatch.setattr(child, "_closing", False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        assert main(["serve", "--port", str(busy.getsockname()[1]), "--progress-every", "0"]) == 1
    assert "cannot listen on" in capsys.readouterr().err
    assert not list(dynprof_dirs["run"].glob("serve-*.token"))


def test_a_serve_that_cannot_use_its_certificate_leaves_no_token_file(capsys, monkeypatch, dynprof_dirs, tmp_path):
    # the server is built (and refuses the certificate) after the token file is written
    monkeypatch.setattr(child, "_closing", False)
    cert = tmp_path / "c.pem"
    cert.write_text("not a certificate")
    argv = ["--port", str(_free_port()), "--certfile", str(cert), "--keyfile", str(tmp_path / "k.pem")]
    assert main(["serve", *argv, "--progress-every", "0"]) == 2
    assert "cannot use the certificate" in capsys.readouterr().err
    assert not list(dynprof_dirs["run"].glob("serve-*.token"))


def test_serve_answers_and_stops_on_sigterm_leaving_no_token_file(capsys, monkeypatch, dynprof_dirs):
    # GIVEN `dynprof serve` on an ephemeral port of 127.0.0.1, a token given on the command line
    monkeypatch.setattr(child, "_closing", False)  # restored after: the stop closes the actions
    port = _free_port()
    token_file = dynprof_dirs["run"] / f"serve-{os.getpid()}.token"
    seen: dict[str, object] = {}
    returned = threading.Event()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def client() -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not returned.is_set():
                try:
                    with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
                        seen["healthz"] = answer.read()
                    request = urllib.request.Request(
                        f"http://127.0.0.1:{port}/api/agents", headers={"Authorization": f"Bearer {TOKEN}"}
                    )
                    with opener.open(request, timeout=30) as answer:
                        seen["agents"] = answer.status
                    seen["token_file"] = token_file.read_text()
                    break
                except OSError:
                    time.sleep(0.1)
        finally:
            if not returned.is_set():
                os.kill(os.getpid(), signal.SIGTERM)  # WHEN it is sent SIGTERM

    helper = threading.Thread(target=client)
    helper.start()
    try:
        code = main(["serve", "--port", str(port), "--token", TOKEN, "--progress-every", "0"])
    finally:
        returned.set()
        helper.join(90)
    # THEN it answered, with the token file of its job-wide actions in place, and stopped cleanly
    assert code == 0
    assert seen.get("healthz") == b"ok\n" and seen.get("agents") == 200, seen
    assert seen.get("token_file") == TOKEN + "\n"
    assert not token_file.exists()
    err = capsys.readouterr().err
    assert "dynprof: warning: --token is visible to every user" in err
    assert f"dynprof: serving on http://127.0.0.1:{port}/?token={TOKEN}\n" in err
    assert "connections at once (open-file limit" in err and "--threads 8)" in err
    assert "dynprof: token from --token\n" in err
    assert err.rstrip().endswith("dynprof: stopped serving")
