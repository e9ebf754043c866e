#!/usr/bin/env python3
"""Peak memory of reading one rank's NCCL dump back from a node, as `dynprof nccl --hosts` does.

A loopback HTTP server plays the node's sidecar and serves one synthetic dump (JSON of the
flight recorder's shape). Each reader runs in its own child process, which prints its peak RSS
above what it held before the read:

- ``in-memory``: the whole answer gathered in memory (``SidecarClient.read_file``), then parsed;
- ``streamed``: the answer streamed to a private file, checked, then parsed
  (``dynprof.job.fetch.read_json_file``, what `nccl --hosts` uses).

    python scripts/bench_nccl_readback.py [MB]      # default 60 (the limit is 64 MiB)
"""

from __future__ import annotations

import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARTIFACT = "j/h/node/nccl/a-1"
NAME = "rank0-pid1.json"

CHILD = """
import resource, sys
sys.path.insert(0, {root!r})
from dynprof.job.client import SidecarClient
from dynprof.nodes import Node
from dynprof.untrusted import loads_json
from dynprof.job.fetch import read_json_file
method, port, size, sha = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
client, node = SidecarClient("t" * 32, timeout=60), Node("127.0.0.1", port)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if method == "in-memory":
    doc = loads_json(client.read_file(node, {artifact!r}, {name!r}, size, sha, 600, 1 << 30), "dump")
else:
    doc = read_json_file(client, node, {artifact!r}, {name!r}, size, sha, 64 << 20, "dump")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(doc["entries"]), (after - before) // 1024)
"""


def synthetic_dump(megabytes: float) -> bytes:
    frame = {"name": "all_reduce", "filename": "/opt/torch/distributed/distributed_c10d.py", "line": 2501}
    entry = {
        "record_id": 0,
        "pg_id": 0,
        "collective_seq_id": 0,
        "profiling_name": "nccl:all_reduce",
        "state": "completed",
        "frames": [frame] * 20,
    }
    one = len(json.dumps(entry)) + 2
    count = max(1, int(megabytes * 1e6 / one))
    return json.dumps({"version": "2.4", "entries": [dict(entry, record_id=i) for i in range(count)]}).encode()


def main() -> int:
    megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    data = synthetic_dump(megabytes)
    sha = hashlib.sha256(data).hexdigest()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    code = CHILD.format(root=str(ROOT), artifact=ARTIFACT, name=NAME)
    print(f"one dump of {len(data) / 2**20:.1f} MiB; peak RSS of the read, above the reader's own:")
    peaks = {}
    try:
        with tempfile.TemporaryDirectory():
            for method in ("in-memory", "streamed"):
                out = subprocess.run(
                    [sys.executable, "-c", code, method, str(port), str(len(data)), sha],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                entries, peak = out.stdout.split()
                peaks[method] = int(peak)
                print(
                    f"  {method:10s} {int(peak):6d} MiB  ({entries} entries; {int(peak) * 2**20 / len(data):.1f}x the dump)"
                )
    finally:
        httpd.shutdown()
    print(f"streamed / in-memory: {peaks['streamed'] / max(1, peaks['in-memory']):.2f}")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
