"""Which nodes a job-level command reaches: the sidecars of a job's nodes.

A node is a sidecar address, ``HOST[:PORT]`` (port 8787 unless given; IPv6 as ``[::1]:8787``).
Sources, which add up: ``--hosts``, ``--hostfile``, ``--slurm [JOB]`` (Slurm's node list,
expanded as ``scontrol show hostnames`` does) and ``--discover`` (the nodes the ranks of
``--job`` registered in the job's own rendezvous store, read through a local agent).
:func:`resolve_nodes` returns ``None`` when the command should act on this node only (no
option asked for other nodes).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynprof import errors
from dynprof.agents import refresh_records
from dynprof.client import AgentClient
from dynprof.nodes import DEFAULT_PORT, Node, parse_hosts, parse_node, read_hostfile, sidecar_port
from dynprof.proto import pb
from dynprof.registry import list_records

MAX_NODES = 65536


# -- Slurm ------------------------------------------------------------------------------------
MAX_NODELIST_CHARS = 1 << 20
MAX_RANGE_WIDTH = 18  # digits of a range bound; wider numbers are not host indices
SLURM_NODELIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_JOB_ID_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOBID")
SCONTROL_TIMEOUT_S = 15.0
SLURM_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+|\+[0-9]+)?")  # 123, array task 123_4, het job 123+1


def _split_top_level(text: str) -> list[str]:
    """Split a node list at commas and blanks outside brackets."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise errors.UsageError(f"bad Slurm node list: nested [ at character {i + 1}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise errors.UsageError(f"bad Slurm node list: ] without [ at character {i + 1}")
        elif (ch == "," or ch.isspace()) and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise errors.UsageError("bad Slurm node list: a [ is not closed")
    parts.append(text[start:])
    return [p for p in parts if p]


def _bracket_values(body: str, item: str) -> list[str]:
    """``001-004,010`` -> ``["001", "002", "003", "004", "010"]`` (zero padding kept)."""
    values: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or not lo.isascii() or not hi.isascii():
            raise errors.UsageError(f"bad range {part!r} in Slurm node list entry {item!r}")
        if len(lo) > MAX_RANGE_WIDTH or len(hi) > MAX_RANGE_WIDTH:
            raise errors.UsageError(f"range {part!r} in {item!r}: numbers over {MAX_RANGE_WIDTH} digits")
        if not sep:
            values.append(lo)
            continue
        low, high = int(lo), int(hi)
        if high < low:
            raise errors.UsageError(f"range {part!r} in Slurm node list entry {item!r} runs backwards")
        if high - low + 1 > MAX_NODES:
            raise errors.UsageError(f"range {part!r} in {item!r} names more than {MAX_NODES} nodes")
        # As Slurm's hostlist: the width of the lower bound sets the zero padding.
        width = len(lo) if lo.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
        if len(values) > MAX_NODES:
            raise errors.UsageError(f"Slurm node list entry {item!r} names more than {MAX_NODES} nodes")
    return values


def _expand_item(item: str) -> list[str]:
    """One entry: literal text and bracket groups, expanded left to right (the first group
    varies slowest), e.g. ``rack[1-2]-n[01-02]``."""
    pieces: list[list[str]] = []
    rest = item
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            pieces.append([rest])
            break
        if open_at:
            pieces.append([rest[:open_at]])
        close_at = rest.find("]", open_at)
        body = rest[open_at + 1 : close_at]
        if not body.strip():
            raise errors.UsageError(f"empty [] in Slurm node list entry {item!r}")
        pieces.append(_bracket_values(body, item))
        rest = rest[close_at + 1 :]
    total = 1
    for values in pieces:
        total *= len(values)
        if total > MAX_NODES:
            raise errors.UsageError(f"Slurm node list entry {item!r} names more than {MAX_NODES} nodes")
    names = [""]
    for values in pieces:
        names = [a + b for a in names for b in values]
    return names


def expand_nodelist(text: str) -> list[str]:
    """Host names of a Slurm node list, in order, as ``scontrol show hostnames`` prints them:
    ``node[001-004,010]``, ``rack[1-2]-n[01-02]``, ``a1,b[2-3],c``. Malformed or oversized
    lists raise :class:`~dynprof.errors.UsageError`."""
    if len(text) > MAX_NODELIST_CHARS:
        raise errors.UsageError(f"Slurm node list of {len(text)} characters: at most {MAX_NODELIST_CHARS}")
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts += _expand_item(item)
        if len(hosts) > MAX_NODES:
            raise errors.UsageError(f"the Slurm node list names more than {MAX_NODES} nodes")
    if not hosts:
        raise errors.UsageError("the Slurm node list is empty")
    _check_host_names(hosts)
    return hosts


def _check_host_names(hosts: list[str]) -> None:
    for host in hosts:
        if any(c.isspace() or c in "/?#@:[]" or not c.isprintable() for c in host) or len(host) > 253:
            raise errors.UsageError(f"bad node name {host[:80]!r} in the Slurm node list")


def _run_slurm_tool(cmd: list[str]) -> str:
    shown = " ".join(cmd)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=SCONTROL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise errors.UsageError(
            f"{cmd[0]} is not installed here and no Slurm node list is in the environment",
            help="Run the command inside the job's allocation (`srun --overlap --jobid J dynprof ...` sets "
            "SLURM_JOB_NODELIST), or name the nodes with --hosts or --hostfile.",
        ) from None
    except subprocess.TimeoutExpired:
        raise errors.Timeout(f"`{shown}` did not answer within {SCONTROL_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip()[:500] or f"exit status {proc.returncode}"
        raise errors.UsageError(f"`{shown}` failed: {why}")
    return proc.stdout[: MAX_NODELIST_CHARS * 8].decode("utf-8", "replace")


def slurm_job_nodelist(job: str) -> str:
    """The ``NodeList`` of a running Slurm job, from ``scontrol show job``."""
    if not SLURM_JOB_ID.fullmatch(job):
        raise errors.UsageError(f"{job!r} is not a Slurm job id")
    text = _run_slurm_tool(["scontrol", "show", "job", "--oneliner", job])
    match = re.search(r"(?:^|\s)NodeList=(\S+)", text)
    if match is None or match.group(1) in ("(null)", ""):
        raise errors.UsageError(f"Slurm job {job} has no nodes (it is not running)")
    return match.group(1)


def slurm_hosts(job: str | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """Host names of a Slurm job: the environment's node list when it is that job's (or no job
    is named), else ``scontrol show job`` for ``job``. Expanded as ``scontrol show hostnames``
    does; ``scontrol show hostnames`` itself is asked only for a list this parser refuses."""
    env = os.environ if env is None else env
    here = next((env[v] for v in SLURM_JOB_ID_VARIABLES if env.get(v)), None)
    nodelist = next((env[v] for v in SLURM_NODELIST_VARIABLES if env.get(v)), None)
    if nodelist is None or (job and here is not None and job != here):
        if not job:
            raise errors.UsageError(
                "--slurm: no Slurm job here (SLURM_JOB_NODELIST is not set) and no job id given",
                help="Give the job: `--slurm JOBID` (asks scontrol), or run inside the allocation.",
            )
        nodelist = slurm_job_nodelist(job)
    try:
        return expand_nodelist(nodelist)
    except errors.UsageError:
        if shutil.which("scontrol") is None or len(nodelist) > MAX_NODELIST_CHARS:
            raise
    hosts = _run_slurm_tool(["scontrol", "show", "hostnames", nodelist]).split()
    if not hosts or len(hosts) > MAX_NODES:
        raise errors.UsageError(f"`scontrol show hostnames` gave {len(hosts)} names for the Slurm node list")
    _check_host_names(hosts)
    return hosts


# -- the job's own store ---------------------------------------------------------------------
DISCOVER_TIMEOUT_S = 5.0
DISCOVER_ASKED_AGENTS = 3


MAX_CLAIMS_PER_RANK = 4  # distinct sidecars one rank may be registered with (restarts, moves)
MAX_REFUSED_SHOWN = 20


@dataclass
class Discovery:
    """What the job's rendezvous store says: every registered rank, and the nodes they name.

    The store has no authentication: whoever reaches its port can write ``dynprof/`` keys. So
    a registration is a hint. Only those whose sidecar is an allowed node (see
    :class:`AllowedNodes`), or is verified by TLS, are used; the others are in ``refused``
    with the reason. Every allowed claim of a rank is kept (a forged line cannot replace a
    real one), and each node's sidecar then says which ranks it really has."""

    job: str
    nodes: list[Node]
    ranks: list[dict[str, Any]]  # rank, local_rank, host, sidecar, pid (one per claim used)
    world_size: int
    store: str
    asked_pid: int
    refused: list[dict[str, Any]] = field(default_factory=list)  # rank, sidecar, reason (at most 20)
    refused_count: int = 0

    @property
    def missing_ranks(self) -> list[int]:
        seen = {r["rank"] for r in self.ranks}
        return [r for r in range(self.world_size) if r not in seen]


def _host_key(host: str) -> str:
    """How two spellings of one host compare, without asking DNS: IP literals by value, names
    case-insensitively, without a trailing dot."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).compressed
    except ValueError:
        return host.lower().rstrip(".")


def _is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _own_host() -> str:
    """This machine's own name (no DNS): a sidecar here is as much this node's as loopback's."""
    return _host_key(socket.gethostname())


@dataclass
class AllowedNodes:
    """The sidecars that registrations read from the job's store may send a command (and the
    token) to, decided without DNS: the nodes named by the operator in the same command
    (``--hosts``, ``--hostfile``, ``--slurm``), ``--allow-hosts``, the nodes of the Slurm
    allocation the command runs in, and this machine (loopback, its own host name); a host
    named without a port is allowed at the sidecar port (``DYNPROF_SIDECAR_PORT``, else 8787)."""

    addresses: set[tuple[str, int]] = field(default_factory=set)
    port: int = DEFAULT_PORT

    def add(self, node: Node) -> None:
        self.addresses.add((_host_key(node.host), node.port))

    def add_host(self, host: str) -> None:
        self.addresses.add((_host_key(host), self.port))

    def allows(self, node: Node) -> bool:
        if (_host_key(node.host), node.port) in self.addresses:
            return True
        return node.port == self.port and (_is_loopback(node.host) or _host_key(node.host) == _own_host())


def allowed_nodes(named: list[Node], allow_hosts: str | None, env: Mapping[str, str] | None = None) -> AllowedNodes:
    env = os.environ if env is None else env
    allowed = AllowedNodes(port=sidecar_port())
    for node in named:
        allowed.add(node)
    for part in (allow_hosts or "").split(","):
        part = part.strip()
        if not part:
            continue
        node = parse_node(part)
        has_port = part.count(":") == 1 if not part.startswith("[") else "]:" in part
        if has_port:
            allowed.add(node)
        else:
            allowed.add_host(node.host)  # no port given: the sidecar port
    nodelist = next((env[v] for v in SLURM_NODELIST_VARIABLES if env.get(v)), None)
    if nodelist:
        try:
            for host in expand_nodelist(nodelist):
                allowed.add_host(host)
        except errors.UsageError:
            pass  # a list this parser refuses allows nothing
    return allowed


def discover_job(
    job: str, timeout: float = DISCOVER_TIMEOUT_S, allowed: AllowedNodes | None = None, tls: bool = False
) -> Discovery:
    """Ask a local agent of ``job`` for the registrations in the job's rendezvous store.

    Each rank's agent registers its host and node sidecar there once the job's default
    process group exists. Up to three local agents (lowest ranks) are asked at once; the first
    answer wins. Registrations are used as :class:`Discovery` says: ``allowed`` nodes only
    (default: loopback and this Slurm allocation's nodes), or any node when ``tls`` verifies
    every sidecar before the token is sent."""
    records = [r for r in list_records() if r.job_id == job]
    if not records:
        records = [r for r in refresh_records(list_records()) if r.job_id == job]
    if not records:
        raise errors.NoAgent(
            f"--discover: no agent of job {job!r} on this node ({socket.gethostname()}) to read the job's store from",
            help="Run the command on a node of the job whose ranks have the dynprof agent (e.g. `srun --overlap "
            f"--jobid J dynprof ... --job {job} --discover`), attach agents here first (`dynprof attach --job "
            f"{job}`), or name the nodes with --hosts, --hostfile or --slurm.",
        )
    records.sort(key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.pid))
    # Up to three local ranks are asked at once, and the first answer wins: in a hung job, a
    # rank whose interpreter is stuck holding the GIL cannot answer, and must not delay the rest.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    asked = records[:DISCOVER_ASKED_AGENTS]

    def ask(record: Any) -> None:
        client = AgentClient.for_record(record, timeout=timeout + 3.0)
        try:
            answers.put((record, client.request(discover_nodes=pb.DiscoverNodesRequest(timeout_s=timeout))))
        except errors.DynprofError as exc:
            answers.put((record, exc))
        except Exception as exc:  # a bug must not leave the command waiting
            answers.put((record, errors.AgentError(f"asking process {record.pid} failed: {exc!r}")))

    for record in asked:
        threading.Thread(target=ask, args=(record,), name="dynprof-discover", daemon=True).start()
    failures: list[tuple[Any, errors.DynprofError]] = []
    while len(failures) < len(asked):
        record, answer = answers.get()
        if isinstance(answer, errors.DynprofError):
            failures.append((record, answer))
            continue
        return _discovery_from(job, record.pid, answer.job_nodes, allowed or allowed_nodes([], None), tls)
    record, exc = failures[0]
    if getattr(exc, "code", None) in (pb.BAD_REQUEST, pb.UNKNOWN_COMMAND):
        # Structured codes: an agent of an older dynprof does not know the command.
        raise errors.DynprofError(
            f"--discover: the agent of process {record.pid} does not know how to read the job's store "
            f"(its dynprof is older than this one): {exc.message}",
            help="Use the same dynprof in the job as here, or name the nodes with --hosts, --hostfile or --slurm.",
        )
    raise exc


def _discovery_from(job: str, pid: int, found: Any, allowed: AllowedNodes, tls: bool = False) -> Discovery:
    world = found.world_size if 0 < found.world_size <= 1 << 24 else 0
    ranks: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    refused_count = 0
    claims: dict[int, set[Node]] = {}
    nodes: list[Node] = []

    def refuse(r: Any, reason: str) -> None:
        nonlocal refused_count
        refused_count += 1
        if len(refused) < MAX_REFUSED_SHOWN:
            refused.append({"rank": r.rank, "sidecar": ascii(r.sidecar[:300])[1:-1], "reason": reason})

    for r in found.ranks:
        if not 0 <= r.rank < world:
            refuse(r, f"rank {r.rank} is not below the world size {world}")
            continue
        try:
            node = parse_node(r.sidecar)
        except errors.UsageError as exc:
            refuse(r, f"an unusable address: {exc.message}")
            continue
        if not tls and not allowed.allows(node):
            refuse(r, "not an allowed node (--allow-hosts, --hosts, --hostfile, --slurm, this machine)")
            continue
        mine = claims.setdefault(r.rank, set())
        if node in mine:
            continue
        if len(mine) >= MAX_CLAIMS_PER_RANK:
            refuse(r, f"rank {r.rank} is registered with more than {MAX_CLAIMS_PER_RANK} sidecars")
            continue
        mine.add(node)
        nodes.append(node)
        ranks.append(
            {
                "rank": r.rank,
                "local_rank": r.local_rank if r.local_rank >= 0 else None,
                "host": r.host,
                "sidecar": r.sidecar,
                "pid": r.pid,
            }
        )
    if not nodes:
        why = f"; {refused_count} registration(s) refused: {refused[0]['reason']}" if refused else ""
        raise errors.DynprofError(
            f"--discover: no rank of job {job!r} is registered in its store ({found.store}){why}",
            help="Ranks register once torch.distributed.init_process_group has returned, and only when the "
            "dynprof agent was in them by then (or attached later); a registration is used only when it names "
            "an allowed node (--allow-hosts HOST[:PORT], --hosts, --slurm's nodes, this machine at the sidecar port) "
            "or --cacert verifies it; name the nodes with --hosts/--hostfile/--slurm.",
        )
    ranks.sort(key=lambda r: r["rank"])
    return Discovery(job, list(dict.fromkeys(nodes)), ranks, found.world_size, found.store, pid, refused, refused_count)


# -- options -----------------------------------------------------------------------------------
def add_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hosts",
        metavar="HOST[:PORT],...",
        help="act through the sidecars (`dynprof serve`) of these nodes, not this node's agents",
    )
    parser.add_argument("--hostfile", metavar="FILE", help="as --hosts, one node per line")
    parser.add_argument(
        "--slurm",
        nargs="?",
        const="",
        metavar="SLURM_JOB",
        help="as --hosts, the nodes of a Slurm job: this allocation's (SLURM_JOB_NODELIST), or the job named "
        "(asks scontrol); sidecar port DYNPROF_SIDECAR_PORT, else 8787",
    )
    parser.add_argument(
        "--discover",
        action="store_true",
        help="as --hosts, the nodes that the ranks of --job registered in the job's own rendezvous store "
        "(asks an agent of the job on this node); only allowed nodes are used (see --allow-hosts)",
    )
    parser.add_argument(
        "--allow-hosts",
        metavar="HOST[:PORT],...",
        help="with --discover: sidecars that registrations in the job's store may name, besides the nodes of "
        "--hosts/--hostfile/--slurm, this Slurm allocation's and this machine's (no port: the sidecar port); the store "
        "is not authenticated, so no other address gets the token unless --cacert verifies it",
    )


def _warn_refused(found: Discovery) -> None:
    if not found.refused_count:
        return
    first = found.refused[0]
    print(
        f"dynprof: warning: --discover: {found.refused_count} registration(s) in the job's store not used "
        f"(rank {first['rank']}: {first['sidecar'][:120]}: {first['reason']}); the store is not authenticated: "
        "allow a node with --allow-hosts HOST[:PORT], or verify the sidecars with --cacert",
        file=sys.stderr,
    )


def resolve_nodes(args: argparse.Namespace) -> list[Node] | None:
    """The nodes asked for, deduplicated in order; None when none was (act on this node only).

    With --discover, ``args.discovery`` is set to the :class:`Discovery` (the ranks that
    registered in the job's store, and ``missing_ranks``)."""
    nodes: list[Node] = []
    asked = False
    if getattr(args, "hosts", None) is not None:
        asked = True
        nodes += parse_hosts(args.hosts)
    if getattr(args, "hostfile", None):
        asked = True
        nodes += read_hostfile(args.hostfile)
    slurm = getattr(args, "slurm", None)
    if slurm is not None:
        asked = True
        port = sidecar_port()
        # --job names the Slurm job only when it is one (a dynprof job id may be a torchrun run id).
        job = getattr(args, "job", None)
        slurm_job = slurm or (job if job and SLURM_JOB_ID.fullmatch(job) else None)
        nodes += [Node(h, port) for h in slurm_hosts(slurm_job)]
    if getattr(args, "discover", False):
        asked = True
        job = getattr(args, "job", None)
        if not job:
            raise errors.UsageError("--discover needs --job JOB: the job whose store names its nodes")
        allowed = allowed_nodes(nodes, getattr(args, "allow_hosts", None))
        found = discover_job(job, allowed=allowed, tls=bool(getattr(args, "cacert", None)))
        args.discovery = found  # who registered and who did not, for the command's report
        nodes += found.nodes
        _warn_refused(found)
    elif getattr(args, "allow_hosts", None):
        raise errors.UsageError("--allow-hosts says which nodes --discover may use: give --discover too")
    if not asked:
        return None
    if not nodes:
        raise errors.UsageError("no nodes given")
    unique = list(dict.fromkeys(nodes))
    if len(unique) > MAX_NODES:
        raise errors.UsageError(f"{len(unique)} nodes: at most {MAX_NODES}")
    return unique
