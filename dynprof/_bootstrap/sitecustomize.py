# Loaded at interpreter start because `dynprof run` put this directory on PYTHONPATH.
# Starts the dynprof agent (when DYNPROF is set), then runs the sitecustomize that this one
# shadows, if there is one, so the job's own start-up customisation still happens.
def _dynprof_bootstrap() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        try:
            import dynprof._startup as startup
        except ImportError:
            home = os.environ.get("DYNPROF_HOME")
            if not home:
                raise
            sys.path.append(home)  # lowest priority: never shadows the job's own packages
            import dynprof._startup as startup
        startup.autostart("run")
    except BaseException as exc:
        try:
            sys.stderr.write(f"dynprof: agent not started: {type(exc).__name__}: {exc}\n")
        except Exception:
            pass

    # Chain to the next sitecustomize on the path.
    saved = sys.modules.pop("sitecustomize", None)
    others = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return
    except BaseException as exc:
        try:
            sys.stderr.write(f"dynprof: the job's sitecustomize failed: {type(exc).__name__}: {exc}\n")
        except Exception:
            pass
    if saved is not None:
        sys.modules["sitecustomize"] = saved


_dynprof_bootstrap()
del _dynprof_bootstrap
