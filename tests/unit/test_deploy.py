"""The deployment examples in scripts/deploy: the manifests parse and say what the sidecar needs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "scripts" / "deploy"


def _load_all(path: Path) -> list[dict]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml comes with the dev tools here
        yaml = None
    if yaml is not None:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    # without pyyaml: at least no tabs, and the top-level keys of a manifest are there
    text = path.read_text()
    assert "\t" not in text
    for key in ("apiVersion:", "kind:", "metadata:", "spec:"):
        assert re.search(rf"^{key}", text, re.M), key
    pytest.skip("pyyaml is not installed: only the shape of the manifest was checked")


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_manifests_parse(path):
    docs = _load_all(path)
    assert docs and all({"apiVersion", "kind", "metadata", "spec"} <= set(d) for d in docs)


def test_sidecar_daemonset_has_what_the_sidecar_needs():
    (ds,) = [d for d in _load_all(DEPLOY / "k8s-sidecar-daemonset.yaml") if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostPID"] is True
    (container,) = pod["containers"]
    args = container["command"]
    assert args[:2] == ["dynprof", "serve"]
    port = int(next(a.split("=", 1)[1] for a in args if a.startswith("--port=")))
    token_file = next(a.split("=", 1)[1] for a in args if a.startswith("--token-file="))
    assert "SYS_PTRACE" in container["securityContext"]["capabilities"]["add"]
    # the readiness probe asks the one path served without a token, on the served port
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["port"] == port
    # the token comes from a Secret, as a file `dynprof serve` accepts (not open to group/others)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    token_volume = volumes[mounts[str(Path(token_file).parent)]]
    assert token_volume["secret"]["secretName"]
    assert token_volume["secret"]["defaultMode"] & 0o077 == 0
    # the run directory and the store are host paths, at the paths the variables name
    env = {e["name"]: e["value"] for e in container["env"]}
    for var in ("DYNPROF_RUN_DIR", "DYNPROF_ARTIFACT_DIR"):
        assert "hostPath" in volumes[mounts[env[var]]], var


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.sh")), ids=lambda p: p.name)
def test_shell_recipes_parse(path):
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_slurm_recipe_documents_the_no_sidecar_path():
    text = (DEPLOY / "slurm_sidecar.sh").read_text()
    assert "srun --jobid" in text and "--overlap --ntasks-per-node=1" in text
    assert 'dynprof stacks --job "$SLURM_JOB_ID" --json' in text and "dynprof stacks --merge" in text
    usage = subprocess.run(["bash", str(DEPLOY / "slurm_sidecar.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_deployments_set_an_open_file_limit_that_fits_their_threads():
    from dynprof.sidecar.server import connection_cap, min_open_files

    # GIVEN the Kubernetes DaemonSet and the Slurm recipe
    (ds,) = [d for d in _load_all(DEPLOY / "k8s-sidecar-daemonset.yaml") if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    args = dict(a.split("=", 1) for a in container["command"] if a.startswith("--") and "=" in a)
    slurm = (DEPLOY / "slurm_sidecar.sh").read_text()
    slurm_threads = int(re.search(r"THREADS=\$\{DYNPROF_SIDECAR_THREADS:-(\d+)\}", slurm).group(1))
    nofile = int(re.search(r"NOFILE=\$\{DYNPROF_SIDECAR_NOFILE:-(\d+)\}", slurm).group(1))
    serve_lines = [ln for ln in slurm.splitlines() if " serve " in ln]
    # THEN each names its threads and an open-file limit the sidecar raises itself to, above
    # what those threads need and with room for far more connections than a default shell's 1024
    assert serve_lines and all('--threads "$THREADS"' in ln or "--threads '$THREADS'" in ln for ln in serve_lines)
    assert all("--max-open-files" in ln for ln in serve_lines)
    for threads, limit in ((int(args["--threads"]), int(args["--max-open-files"])), (slurm_threads, nofile)):
        assert limit >= min_open_files(threads)
        assert connection_cap(threads, limit) > 1024
