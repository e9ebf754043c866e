"""Call one action on the sidecars (`dynprof serve`) of many nodes at once.

The HTTP API of a sidecar (version 1)::

    GET  /api/v1/info                        {"api": 1, "dynprof_version", "host", "actions"}
    POST /api/v1/actions/<name>              {"options": {...}, "timeout": s} ->
         {"api": 1, "action", "host", "dynprof_version", "exit_code", "result", "messages", "error", "elapsed_s"}
    GET  /api/v1/artifacts/<id>              {"id", "manifest", ...}
    GET  /api/v1/artifacts/<id>/files/<name> the file

Requests carry ``Authorization: Bearer TOKEN``; with a CA file (``--cacert``) they go over
https and the sidecar's certificate is verified against it. At most ``max_in_flight`` nodes
are asked at once; each has its own deadline for the whole answer (connecting, sending, the
headers and the body: a node that drips its answer is cut off at the deadline, whatever it
sends). A 429 (busy) is retried once, after its Retry-After when that fits the deadline.

Every answer is untrusted: its bytes and the JSON values it holds are bounded before it is
decoded, its shape checked, and anything else becomes a failure of that node with a reason a
person can act on, never an exception out of here. Files are streamed to disk.

    >>> client = SidecarClient(token)                                  # doctest: +SKIP
    >>> answers = client.action_all(nodes, "ps", {"job": "j1"})          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import http.client
import itertools
import json
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

from dynprof import __version__, errors
from dynprof.errors import ArtifactError
from dynprof.job.budget import TOTAL_ANSWER_BYTES, TOTAL_ANSWER_VALUES, AnswerBudget, AnswerShare, ManifestBudget
from dynprof.nodes import CommandError, Node, NodeAnswer
from dynprof.units import human_bytes
from dynprof.untrusted import MANIFEST_MAX_BYTES, count_json_values, loads_json

API_VERSION = 1
DEFAULT_MAX_IN_FLIGHT = 64
DEFAULT_NODE_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 80 * 1024 * 1024  # a sidecar's action output is capped at 64 MiB, plus the envelope
MAX_SMALL_ANSWER_BYTES = 1024 * 1024  # info, errors
# The listing actions answer a few hundred bytes to a few kilobytes per process or artifact:
# 16 MiB holds thousands per node, and keeps a job-wide listing (in the CLI, or in the sidecar
# that answers it for the page) from growing by hundreds of MB on a hostile node's answer; other actions may answer up to the sidecar's
# 64 MiB (stacks of many threads, NCCL entries).
LISTING_ANSWER_BYTES = dict.fromkeys(("ps", "stop", "ls"), 16 * 1024 * 1024)
MAX_LISTING_PROGRESS_BYTES = 16 * 1024 * 1024  # a progress document: ~500 bytes per rank
# JSON values one answer may hold (counted before it is decoded): the answers of real nodes
# hold thousands (ps, ls) to a few hundred thousand (stacks of many threads, NCCL entries).
MAX_ANSWER_VALUES = 500_000
# An artifact's manifest, as a fetch asks for it: a store's manifest is read up to 1 MiB
# (untrusted.MANIFEST_MAX_BYTES); JSON's escapes may double it, plus the envelope.
MAX_MANIFEST_ANSWER_BYTES = 2 * MANIFEST_MAX_BYTES + 64 * 1024
MAX_MANIFEST_ANSWER_VALUES = 100_000
MAX_SMALL_ANSWER_VALUES = 20_000
MAX_FILE_BYTES = 64 * 1024**3
MAX_MESSAGES = 200
MAX_RETRY_AFTER_S = 30.0
_CHUNK = 1 << 16
_SAFE_SEGMENT = re.compile(r"[A-Za-z0-9_.@+-]{1,255}")
_RANK_SEGMENT = re.compile(r"rank-?[0-9]{1,10}|node")  # ASCII digits only
ARTIFACT_ID_SEGMENTS = 5  # job/host/rank/kind/name
_NAME_MISMATCH = (62, 64)  # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


class NodeFailure(Exception):
    """A node did not answer usefully; ``reason`` says why in a person's words; ``cut``: its
    answer was dropped because the command's total for all nodes was reached."""

    def __init__(self, reason: str, status: int | None = None, cut: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.cut = cut


def tls_context(cacert: str) -> ssl.SSLContext:
    """Verify the sidecars' certificates against ``cacert`` (a PEM file of CA or self-signed certs)."""
    try:
        return ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        raise errors.UsageError(
            f"cannot use the CA file {cacert}: {exc}",
            help="Give a PEM file holding the CA that signed the sidecars' certificates.",
        ) from None


class _Deadlines:
    """One daemon thread that shuts down the socket of every request whose deadline has
    passed: a blocked connect, send or read then returns at once, however the node drips.
    (A socket timeout alone bounds each ``recv``, not the answer: one byte a second never
    trips it.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Any] = {}  # id -> the connection, while its request runs
        self._fired: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, conn: http.client.HTTPConnection, deadline: float) -> int:
        with self._lock:
            key = next(self._ids)
            self._live[key] = conn
            heapq.heappush(self._heap, (deadline, key))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dynprof-deadlines", daemon=True)
                self._thread.start()
            self._wake.notify()
            return key

    def done(self, key: int) -> bool:
        """Stop watching; True when the deadline fired."""
        with self._lock:
            self._live.pop(key, None)
            if key in self._fired:
                self._fired.discard(key)
                return True
            return False

    def _run(self) -> None:
        with self._lock:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait(30.0)
                    if not self._heap:
                        self._thread = None
                        return
                    continue
                deadline, key = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                heapq.heappop(self._heap)
                conn = self._live.get(key)
                self._fired.add(key)
                sock = getattr(conn, "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


_DEADLINES = _Deadlines()


class SidecarClient:
    """Talks to sidecars over HTTP(S): one action on many nodes, artifact files back."""

    def __init__(
        self,
        token: str,
        *,
        tls: ssl.SSLContext | None = None,
        timeout: float = DEFAULT_NODE_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        total_bytes: int | None = None,
        total_values: int | None = None,
    ) -> None:
        self.token = token
        self.tls = tls
        self.timeout = timeout
        self.max_in_flight = max(1, max_in_flight)
        # The bound on what one command keeps of all its nodes' answers (AnswerBudget):
        # ``action_all`` shares it among its nodes; a request made for one node alone
        # (``action``, ``progress``) may keep ``1 / (shared_by * answers_per_node)`` of it,
        # ``shared_by`` being how many nodes' answers its caller holds at once and
        # ``answers_per_node`` how many of each (the watch: its nodes, their progress and stacks).
        self.total_bytes = TOTAL_ANSWER_BYTES if total_bytes is None else total_bytes
        self.total_values = TOTAL_ANSWER_VALUES if total_values is None else total_values
        self.shared_by = 1
        self.answers_per_node = 1
        self.last_budget: AnswerBudget | None = None  # the last action_all's, as it ended
        # The artifact manifests this client's command holds at once (``manifest``), whichever
        # of its threads reads them.
        self.manifests = ManifestBudget(self.max_in_flight)

    def _alone(self) -> AnswerShare:
        return AnswerBudget(
            self.shared_by, self.total_bytes, self.total_values, pooled=False, per_node=self.answers_per_node
        ).share()

    # -- one request ------------------------------------------------------------------------
    def _connection(self, node: Node, timeout: float) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection(node.host, node.port, timeout=timeout, context=self.tls)
        return http.client.HTTPConnection(node.host, node.port, timeout=timeout)

    def _request(
        self,
        node: Node,
        method: str,
        path: str,
        body: bytes | None,
        deadline: float,
        max_bytes: int,
        sink: Any = None,
        share: AnswerShare | None = None,
    ) -> tuple[int, dict[str, str], bytearray]:
        """(status, headers, body) of one request, all of it before ``deadline``; the body goes
        to ``sink.write`` instead when given. A 200 body kept in memory draws on ``share``
        (the command's total for all nodes) as it arrives. Raises :class:`NodeFailure`."""
        started = time.monotonic()
        total = max(0.05, deadline - started)
        phase = "connecting to"
        watch: int | None = None
        try:
            conn = self._connection(node, min(total, self.timeout))
        except (http.client.HTTPException, ValueError) as exc:
            raise NodeFailure(f"bad node address {node.address!r}: {type(exc).__name__}") from None
        try:
            watch = _DEADLINES.watch(conn, started + total)
            conn.connect()
            phase = "waiting for"
            headers = {
                "Authorization": f"Bearer {self.token}",
                "Accept": "application/json",
                "User-Agent": f"dynprof/{__version__}",
            }
            if body is not None:
                headers["Content-Type"] = "application/json"
            _set_timeout(conn, deadline)
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            phase = "reading the answer of"
            if resp.status == 200 and resp.length is not None and resp.length > max_bytes:
                raise NodeFailure(f"the answer is over {human_bytes(max_bytes)}: refused", resp.status)
            # A refusal (401, 404, 5xx) is read for its reason only: its first MiB.
            keep = max_bytes if resp.status == 200 else min(max_bytes, MAX_SMALL_ANSWER_BYTES)
            # An answer kept in memory draws on the command's total: all at once when its
            # length is known (answers read at once do not each draw part and all fall short).
            drawing = share is not None and resp.status == 200 and sink is None
            if drawing and share is not None and resp.length is not None:
                if not share.take_bytes(resp.length):
                    raise NodeFailure(share.budget.reason("bytes", node), resp.status, cut=True)
                drawing = False
            got = bytearray()
            size = 0
            truncated = False
            while True:
                if deadline - time.monotonic() <= 0:
                    raise TimeoutError()
                _set_timeout(conn, deadline)
                chunk = resp.read1(_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > keep:
                    if resp.status != 200:
                        truncated = True
                        break
                    raise NodeFailure(f"the answer is over {human_bytes(max_bytes)}: refused", resp.status)
                if sink is not None and resp.status == 200:
                    sink.write(chunk)
                    continue
                if drawing and share is not None and not share.take_bytes(len(chunk)):
                    raise NodeFailure(share.budget.reason("bytes", node), resp.status, cut=True)
                got += chunk
            if resp.length and not truncated:  # a Content-Length the connection's end fell short of
                raise NodeFailure(f"the answer of {node} was cut off ({resp.length} bytes missing)", resp.status)
            if watch is not None and _DEADLINES.done(watch):
                watch = None
                raise TimeoutError()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, got
        except Exception as exc:
            fired = watch is not None and _DEADLINES.done(watch)
            watch = None
            if fired or isinstance(exc, TimeoutError):
                elapsed = time.monotonic() - started
                raise NodeFailure(
                    f"timed out after {elapsed:.3g} s {phase} {node}"
                    + (" (the node is down, or a firewall drops the port)" if phase == "connecting to" else "")
                ) from None
            raise _failure(node, exc, self.tls is not None) from None
        finally:
            if watch is not None:
                _DEADLINES.done(watch)
            conn.close()

    def _call_json(
        self,
        node: Node,
        method: str,
        path: str,
        payload: Any,
        deadline: float,
        max_bytes: int,
        max_values: int = MAX_SMALL_ANSWER_VALUES,
        share: AnswerShare | None = None,
    ) -> dict[str, Any]:
        """A JSON request with one retry on 429; the answer's JSON object, or :class:`NodeFailure`.
        The answer is decoded only when it holds at most ``max_values`` JSON values, and, given
        a ``share`` of the command's total, only when the share has room for them (kept when
        the answer is, given back when it is not)."""
        with share.holding() if share is not None else contextlib.nullcontext():
            body = None if payload is None else json.dumps(payload).encode()
            for attempt in (1, 2):
                if share is not None:
                    share.release()  # a refusal's body, or a retried answer, is not kept
                status, headers, data = self._request(node, method, path, body, deadline, max_bytes, share=share)
                if status == 429 and attempt == 1:
                    wait = _retry_after(headers.get("retry-after"))
                    if time.monotonic() + wait < deadline - 0.5:
                        time.sleep(wait)
                        continue
                if status != 200:
                    raise NodeFailure(_http_reason(node, status, data, path), status)
                values = count_json_values(data)
                if values > max_values:
                    raise NodeFailure(f"the answer of {node} to {path} holds over {max_values} JSON values: refused")
                if share is not None and not share.take_values(values):
                    raise NodeFailure(share.budget.reason("values", node), cut=True)
                try:
                    # The text alone while it is parsed: the bytes go first (an answer may be 80 MiB).
                    text = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise NodeFailure(
                        f"not a dynprof sidecar: the answer of {node} to {path}: not valid JSON ({str(exc)[:120]})"
                    ) from None
                del data
                try:
                    doc = loads_json(text, f"the answer of {node} to {path}")
                except ArtifactError as exc:
                    raise NodeFailure(f"not a dynprof sidecar: {exc.message}") from None
                if not isinstance(doc, dict):
                    raise NodeFailure(f"not a dynprof sidecar: {node} answered {path} with JSON that is not an object")
                api = doc.get("api")
                if api != API_VERSION and "api" in doc:
                    raise NodeFailure(f"api version {_short(api)} on {node}, this CLI speaks {API_VERSION}")
                return doc
            raise AssertionError("unreachable")  # pragma: no cover

    # -- the API ----------------------------------------------------------------------------
    def info(self, node: Node) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        doc = self._call_json(node, "GET", "/api/v1/info", None, deadline, MAX_SMALL_ANSWER_BYTES)
        if doc.get("api") != API_VERSION:
            raise NodeFailure(f"not a dynprof sidecar: {node} gave no api version")
        return doc

    def progress(self, node: Node, job: str | None = None, fresh: bool = False) -> dict[str, Any]:
        """The node's progress document (``GET /api/v1/progress[?job=J][&fresh=1]``), undecoded
        (the watch decodes it with ``NodeProgress.from_json``); :class:`NodeFailure` when none
        comes. ``fresh``: read the agents now, not the node's last poll."""
        deadline = time.monotonic() + self.timeout
        query = ([f"job={quote(job, safe='')}"] if job else []) + (["fresh=1"] if fresh else [])
        path = "/api/v1/progress" + ("?" + "&".join(query) if query else "")
        return self._call_json(
            node, "GET", path, None, deadline, MAX_LISTING_PROGRESS_BYTES, MAX_ANSWER_VALUES, self._alone()
        )

    def action(
        self,
        node: Node,
        name: str,
        options: dict[str, Any],
        timeout: float | None = None,
        share: AnswerShare | None = None,
    ) -> NodeAnswer:
        """Run action ``name`` on ``node``; ``timeout`` bounds the action on the node, and the
        node then has this client's timeout more to answer. The answer draws on ``share`` (of
        the command's total), else on ``1 / (shared_by * answers_per_node)`` of it."""
        started = time.monotonic()
        deadline = started + self.timeout + (timeout or 0.0)
        payload: dict[str, Any] = {"options": options}
        if timeout is not None:
            payload["timeout"] = timeout
        try:
            doc = self._call_json(
                node,
                "POST",
                f"/api/v1/actions/{quote(name, safe='')}",
                payload,
                deadline,
                min(MAX_ANSWER_BYTES, LISTING_ANSWER_BYTES.get(name, MAX_ANSWER_BYTES)),
                MAX_ANSWER_VALUES,
                share if share is not None else self._alone(),
            )
            return _answer(node, doc, name, time.monotonic() - started)
        except NodeFailure as exc:
            elapsed = time.monotonic() - started
            return NodeAnswer(node, False, error=exc.reason, elapsed_s=elapsed, status=exc.status, cut=exc.cut)

    def action_all(
        self,
        nodes: Sequence[Node],
        name: str,
        options: dict[str, Any] | Callable[[Node], dict[str, Any]],
        timeout: float | None = None,
    ) -> list[NodeAnswer]:
        """``action`` on every node, at most ``max_in_flight`` at once; answers in node order.
        ``options``: the same for every node, or each node's (a function of it). The answers
        share this client's total (:class:`AnswerBudget`): a node whose answer would take it
        past it is cut (``cut`` set, the reason in ``error``)."""
        if not nodes:
            return []
        budget = AnswerBudget(len(nodes), self.total_bytes, self.total_values)
        self.last_budget = budget
        of = options if callable(options) else (lambda _n: options)
        with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(nodes))) as pool:
            return list(pool.map(lambda n: self.action(n, name, of(n), timeout, budget.share()), nodes))

    def artifact(self, node: Node, artifact_id: str, share: AnswerShare | None = None) -> dict[str, Any]:
        """An artifact's manifest, as the node's store has it (``{"id", "manifest"}``): at most
        :data:`MAX_MANIFEST_ANSWER_BYTES`, drawn on ``share`` of :attr:`manifests` (the
        command's total; a manifest past what is left is cut: :class:`NodeFailure` with
        ``cut``). Without a share it is counted while it is read only: a caller that holds it
        does so with :meth:`manifest`, which counts it until the caller is done with it."""
        check_artifact_id(artifact_id)
        own = share is None
        drawn = self.manifests.share() if share is None else share
        try:
            doc = self._call_json(
                node,
                "GET",
                "/api/v1/artifacts/" + quote(artifact_id) + "?manifest=1",
                None,
                time.monotonic() + self.timeout,
                MAX_MANIFEST_ANSWER_BYTES,
                MAX_MANIFEST_ANSWER_VALUES,
                drawn,
            )
        finally:
            if own:
                drawn.done()
        if not isinstance(doc.get("manifest"), dict):
            raise NodeFailure(f"not a dynprof sidecar: the artifact {artifact_id} of {node} has no manifest")
        return doc

    @contextlib.contextmanager
    def manifest(self, node: Node, artifact_id: str) -> Iterator[dict[str, Any]]:
        """``with client.manifest(node, id) as doc:`` the artifact's manifest (``artifact``),
        counted in the command's total of manifests held at once until the block ends."""
        share = self.manifests.share()
        try:
            yield self.artifact(node, artifact_id, share)
        finally:
            share.done()

    def download(
        self, node: Node, artifact_id: str, name: str, dest: Path, size: int, sha256: str, timeout: float
    ) -> None:
        """Copy one file of an artifact to ``dest``, checking its size and sha256 against the
        manifest's; nothing is left at ``dest`` when they differ."""
        check_artifact_id(artifact_id)
        check_file_name(name)
        tmp = dest.with_name(f".{dest.name}.part")
        digest = hashlib.sha256()

        class Sink:
            def __init__(self, fh: Any) -> None:
                self.fh = fh

            def write(self, chunk: bytes) -> None:
                digest.update(chunk)
                self.fh.write(chunk)

        path = f"/api/v1/artifacts/{quote(artifact_id)}/files/{quote(name, safe='')}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                try:
                    status, _, data = self._request(
                        node, "GET", path, None, time.monotonic() + timeout, min(size, MAX_FILE_BYTES), Sink(fh)
                    )
                except NodeFailure as exc:
                    raise NodeFailure(f"{artifact_id}/{name}: {exc.reason}", exc.status) from None
            if status != 200:
                raise NodeFailure(_http_reason(node, status, data, path), status)
            got = tmp.stat().st_size
            if got != size:
                raise NodeFailure(f"{artifact_id}/{name}: {got} bytes arrived, the manifest says {size}")
            if digest.hexdigest() != sha256:
                raise NodeFailure(f"{artifact_id}/{name}: sha256 differs from the manifest's")
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                tmp.unlink()

    def read_file(
        self, node: Node, artifact_id: str, name: str, size: int, sha256: str, timeout: float, max_bytes: int
    ) -> bytes:
        """One file of an artifact, in memory, checked against the manifest's size and sha256;
        a file over ``max_bytes`` is refused before it is read."""
        check_artifact_id(artifact_id)
        check_file_name(name)
        if size > max_bytes:
            raise NodeFailure(f"{artifact_id}/{name}: {human_bytes(size)}, over the {human_bytes(max_bytes)} read back")
        path = f"/api/v1/artifacts/{quote(artifact_id)}/files/{quote(name, safe='')}"
        try:
            status, _, data = self._request(node, "GET", path, None, time.monotonic() + timeout, size)
        except NodeFailure as exc:
            raise NodeFailure(f"{artifact_id}/{name}: {exc.reason}", exc.status) from None
        if status != 200:
            raise NodeFailure(_http_reason(node, status, data, path), status)
        if len(data) != size:
            raise NodeFailure(f"{artifact_id}/{name}: {len(data)} bytes arrived, the manifest says {size}")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise NodeFailure(f"{artifact_id}/{name}: sha256 differs from the manifest's")
        return bytes(data)


# -- checking what came back -------------------------------------------------------------------
def _short(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _set_timeout(conn: http.client.HTTPConnection, deadline: float) -> None:
    if conn.sock is not None:
        conn.sock.settimeout(max(0.05, deadline - time.monotonic()))


def _failure(node: Node, exc: Exception, tls: bool) -> NodeFailure:
    """What went wrong with one request, in a person's words."""
    if isinstance(exc, NodeFailure):
        return exc
    if isinstance(exc, ConnectionRefusedError):
        return NodeFailure(f"connection refused: is `dynprof serve` running on {node}?")
    if isinstance(exc, socket.gaierror):
        return NodeFailure(f"unknown host {node.host}: {exc.strerror or exc}")
    if isinstance(exc, ssl.SSLCertVerificationError):
        if exc.verify_code in _NAME_MISMATCH:
            return NodeFailure(
                f"the TLS certificate of {node} does not name {node.host} ({exc.verify_message}); "
                "name the node as its certificate does"
            )
        return NodeFailure(
            f"the TLS certificate of {node} is not trusted: {exc.verify_message or exc}; "
            "give the CA that signed it with --cacert"
        )
    if isinstance(exc, ssl.SSLError):
        return NodeFailure(f"TLS failed with {node} ({exc.reason or exc}): does its sidecar serve https?")
    if isinstance(exc, (http.client.BadStatusLine, http.client.RemoteDisconnected, ConnectionResetError)):
        hint = "" if tls else "; if the sidecar serves https, give --cacert"
        return NodeFailure(f"no HTTP answer from {node} ({type(exc).__name__}){hint}")
    if isinstance(exc, (http.client.HTTPException, ValueError)):
        return NodeFailure(f"a malformed HTTP answer from {node}: {type(exc).__name__}: {str(exc)[:200]}")
    if isinstance(exc, OSError):
        return NodeFailure(f"connection to {node} failed: {exc}")
    return NodeFailure(f"the exchange with {node} failed: {type(exc).__name__}: {str(exc)[:200]}")


def _retry_after(value: str | None) -> float:
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        seconds = 1.0
    if not 0 <= seconds < float("inf"):
        seconds = 1.0
    return min(seconds, MAX_RETRY_AFTER_S)


def _http_reason(node: Node, status: int, data: bytes | bytearray, path: str) -> str:
    detail = ""
    try:
        doc = (
            loads_json(data[:MAX_SMALL_ANSWER_BYTES], "an error", max_values=MAX_SMALL_ANSWER_VALUES) if data else None
        )
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            detail = doc["error"][:300]
    except ArtifactError:
        pass
    if status == 401:
        return f"401: wrong token: {node} refused it (check --token-file / DYNPROF_TOKEN_FILE)"
    if status == 403:
        return f"403: {node} refused the request" + (f": {detail}" if detail else "")
    if status == 404:
        if "/artifacts/" in path:
            return f"404: no such artifact or file on {node}"
        return f"not a dynprof sidecar: {node} has no {path.split('?')[0]} (404); is it `dynprof serve` of API 1?"
    if status == 413:
        return f"413: the request is too large for {node}"
    if status == 429:
        return f"429: {node} is busy (it refused again after waiting); retry later"
    if status == 400:
        return f"400: {node} refused the request" + (f": {detail}" if detail else "")
    if status >= 500:
        return f"{status}: the sidecar on {node} failed" + (f": {detail}" if detail else "") + "; see its log"
    return f"HTTP {status} from {node}" + (f": {detail}" if detail else "")


def _answer(node: Node, doc: dict[str, Any], name: str, elapsed: float) -> NodeAnswer:
    def bad(what: str) -> NodeFailure:
        return NodeFailure(f"not a dynprof sidecar: the answer of {node} to {name} {what}")

    if doc.get("api") != API_VERSION:
        raise bad("has no api version")
    code = doc.get("exit_code")
    if isinstance(code, bool) or not isinstance(code, int) or not -255 <= code <= 255:
        raise bad("has no exit code")
    host = doc.get("host")
    if host is not None and not isinstance(host, str):
        raise bad("names no host")
    messages = doc.get("messages") or []
    if not isinstance(messages, list):
        raise bad("has messages that are not a list")
    version = doc.get("dynprof_version")
    try:
        failure = _command_error(doc.get("error"))
    except ValueError:
        raise bad("has an error that is not {type, message, help, exit_code}") from None
    return NodeAnswer(
        node,
        True,
        host=host[:253] if host else None,
        exit_code=code,
        result=doc.get("result"),
        messages=[m[:2000] if isinstance(m, str) else f"({type(m).__name__})" for m in messages[:MAX_MESSAGES]],
        elapsed_s=elapsed,
        dynprof_version=version[:40] if isinstance(version, str) else None,
        failure=failure,
    )


def _command_error(value: Any) -> CommandError | None:
    """The answer's ``error`` (None when there is none); ValueError when it is malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("not an object")
    kind, message, help_text, code = (value.get(k) for k in ("type", "message", "help", "exit_code"))
    if not isinstance(kind, str) or not isinstance(message, str) or not isinstance(help_text, (str, type(None))):
        raise ValueError("a field is not text")
    if isinstance(code, bool) or not isinstance(code, int) or not -255 <= code <= 255:
        raise ValueError("no exit code")
    return CommandError(kind[:100], message[:2000], (help_text or "")[:2000], code)


def check_artifact_id(artifact_id: Any) -> str:
    """An artifact id as the store lays it out: exactly ``job/host/rank/kind/name`` (rank
    ``rankN`` or ``node``), each segment plain and not hidden (no ``..``, no temporary
    ``.name.tmp``); anything else could name a path outside a fetch directory, or, with more
    segments, one inside another artifact's directory."""
    if not isinstance(artifact_id, str) or len(artifact_id) > 1024:
        raise NodeFailure(f"bad artifact id {_short(artifact_id)}")
    parts = artifact_id.split("/")
    if (
        len(parts) != ARTIFACT_ID_SEGMENTS
        or any(p.startswith(".") or not _SAFE_SEGMENT.fullmatch(p) for p in parts)
        or not _RANK_SEGMENT.fullmatch(parts[2])
    ):
        raise NodeFailure(
            f"bad artifact id {_short(artifact_id)}: not job/host/rank/kind/name as the store lays it out"
        )
    return artifact_id


def check_file_name(name: Any) -> str:
    if not isinstance(name, str) or name in (".", "..") or name.startswith(".") or not _SAFE_SEGMENT.fullmatch(name):
        raise NodeFailure(f"bad file name {_short(name)} in a manifest")
    return name
