"""A Python wrapper that runs the training script as its child, as launchers do.

    python wrapper_program.py SCRIPT ARGS...

runs ``python SCRIPT ARGS...`` as a child process (the way accelerate's simple launcher and
many job scripts start the real trainer), passes SIGTERM on to it, and exits with its exit code.
"""

from __future__ import annotations

import signal
import subprocess
import sys

if __name__ == "__main__":
    child = subprocess.Popen([sys.executable, *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    sys.exit(child.wait())
