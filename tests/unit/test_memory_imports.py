"""What the agent's memory extension loads into every job: the capture and the history policy,
never the untrusted snapshot unpickler, the summaries or the renderers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Modules that hold the snapshot unpickler, the summaries and advice, or the text and HTML
# renderers: before and after they became one package.
NOT_IN_THE_JOB = (
    "collectors.memory.reader",
    "collectors.memory.summary",
    "collectors.memory.advice",
    "collectors.memory.render",
    "collectors.memory_snapshot",
    "collectors._mem_html",
    "collectors._mem_advice",
)

PROGRAM = r"""
import json, sys
import torch  # noqa: F401  (a job imports torch; the extension hooks torch.cuda)
import dynprof.agent._ext_memory  # the extension alone
import dynprof.agent

agent = dynprof.agent.start()
ready = agent is not None and agent.wait_ready(60)
loaded = sorted(m for m in sys.modules if m.startswith("collectors"))
installed = agent is not None and "dynprof.agent._ext_memory" in agent.extensions
dynprof.agent.shutdown()
print(json.dumps({"ready": ready, "installed": installed, "loaded": loaded}))
"""


def test_the_agents_memory_extension_loads_only_capture_and_policy():
    # GIVEN a job that imports torch, then the memory extension, then starts the agent
    env = {k: v for k, v in os.environ.items() if k != "DYNPROF"}
    env["PYTHONPATH"] = str(ROOT)
    # WHEN the agent is ready (its extensions imported and installed)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ready"] and doc["installed"], proc.stderr
    # THEN the job holds the capture and the policy, and none of the readers, summaries, renderers
    loaded = set(doc["loaded"])
    assert sorted(loaded & set(NOT_IN_THE_JOB)) == []
    assert {"collectors.memory.capture", "collectors.memory.policy"} <= loaded
