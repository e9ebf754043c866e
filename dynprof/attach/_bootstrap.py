"""What runs inside the target: a one-statement payload and the bootstrap it starts.

The payload is what CPython runs on the main thread (as a pending call, under
``PyGILState_Ensure``, or through ``sys.remote_exec``). It binds no name in ``__main__`` and
cannot raise: it only starts the daemon thread ``dynprof-attach``, which runs the bootstrap in
a namespace of its own. The bootstrap imports dynprof from the target's own ``sys.path`` (the
CLI's copy is appended at lowest priority, as ``dynprof run``'s sitecustomize does with
``DYNPROF_HOME``), starts the agent with ``activation="attach"`` and the CLI's settings, and
reports back through files in a private directory of the CLI's:

* ``ran.json`` as soon as the thread runs (the main thread reached the safe point);
* ``result.json`` once the agent is ready, or with the error that stopped it.

Each file is written once (the first writer wins), so a bootstrap that runs twice (the
pending call firing after the fallback already ran) cannot overwrite the first answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

THREAD_NAME = "dynprof-attach"
RAN_FILE = "ran.json"
RESULT_FILE = "result.json"

# Runs on the dynprof-attach thread, in its own globals. Standard library only until dynprof
# is imported; every failure is reported, none escapes into the job.
_SOURCE = r"""
import json, os, sys, threading, time

_CFG = __CFG__


def _write_once(name, data):
    path = os.path.join(_CFG["dir"], name)
    tmp = "%s.%d.%d.tmp" % (path, os.getpid(), threading.get_ident())
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        os.unlink(tmp)
    except Exception:
        pass


def _main():
    info = {
        "pid": os.getpid(),
        "via": _CFG["via"],
        "executable": sys.executable,
        "python": sys.version.split()[0],
        "ran_at": time.time(),
    }
    _write_once("ran.json", info)
    stage = "import"
    try:
        try:
            import dynprof.agent
        except ImportError:
            home = _CFG["home"]
            if not home or home in sys.path:
                raise
            for name in [m for m in sys.modules if m == "dynprof" or m.startswith("dynprof.")]:
                if getattr(sys.modules[name], "__file__", None) is None:
                    del sys.modules[name]
            sys.path.append(home)
            import dynprof.agent
        import dynprof
        info["dynprof_file"] = getattr(dynprof, "__file__", None)
        info["dynprof_version"] = getattr(dynprof, "__version__", None)
        import dynprof.proto  # the agent's server thread needs protobuf
        try:
            from dynprof import _settings
        except ImportError:
            info.update(ok=False, kind="old-dynprof", error="this dynprof predates attach (no dynprof._settings)")
            _write_once("result.json", info)
            return
        stage = "start"
        agent = dynprof.agent.get()
        if agent is not None:
            info.update(already=True, activation=agent.activation)
        else:
            _settings.set_overrides(_CFG["settings"])
            agent = dynprof.agent.start(activation="attach")
            info["already"] = False
        if agent is None:
            info.update(ok=False, kind="agent", error="dynprof.agent.start() failed")
        else:
            ready = agent.wait_ready(_CFG["ready_timeout"])
            record = agent.record
            info.update(
                ok=ready,
                kind=None if ready else "agent",
                error=None if ready else "the agent's server did not become ready",
                socket=record.socket if record is not None else None,
                log=agent.log_path,
                hook_installed=agent.steps.hook_installed,
                torch_imported="torch" in sys.modules,
            )
        info["ready_at"] = time.time()
        _write_once("result.json", info)
    except BaseException as exc:
        info.update(
            ok=False,
            kind=stage,
            error="%s: %s" % (type(exc).__name__, exc),
            missing=getattr(exc, "name", None),
            sys_path=list(sys.path)[:12],
        )
        _write_once("result.json", info)


try:
    _main()
except BaseException:
    pass
"""


def bootstrap_source(
    result_dir: str,
    home: str,
    settings: Mapping[str, str],
    via: str,
    ready_timeout: float = 20.0,
) -> str:
    """The bootstrap's source text, with its configuration inlined as a literal."""
    config: dict[str, Any] = {
        "dir": result_dir,
        "home": home,
        "settings": dict(settings),
        "via": via,
        "ready_timeout": float(ready_timeout),
    }
    return _SOURCE.replace("__CFG__", repr(config), 1)


def payload(source: str) -> str:
    """The statement the main thread runs: start the bootstrap thread, bind nothing, never raise."""
    return (
        "try:\n"
        " __import__('threading').Thread(target=exec, args=("
        f"{source!r}, {{'__name__': '__dynprof_attach__'}}), name={THREAD_NAME!r}, daemon=True).start()\n"
        "except BaseException:\n"
        " pass\n"
    )
