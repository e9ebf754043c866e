#!/bin/bash
# Slurm prolog: check the node's GPUs before a job starts on it; drain the node if unhealthy.
#
# Install: copy to /etc/slurm/prolog.d/50-dynprof-healthcheck.sh (or set Prolog= in slurm.conf)
# on every compute node, with dynprof installed in $DYNPROF_PYTHON's environment.
#
# dynprof healthcheck exit codes (stable):
#   0 healthy      -> the job starts
#   1 warning      -> the job starts; the warning is logged and exported to Prometheus
#   2 unhealthy    -> the node is drained with the failing checks as reason; the job is requeued
#   3 could not run -> the job starts unless DYNPROF_STRICT=1 (then treated as unhealthy)
# A prolog that exits non-zero makes Slurm drain the node and requeue the job itself; we drain
# explicitly first so that the reason names the failing check.

set -u
DYNPROF_PYTHON=${DYNPROF_PYTHON:-/opt/dynprof/bin/python}
LEVEL=${DYNPROF_HEALTHCHECK_LEVEL:-quick}   # quick: seconds; standard: < 1 min, catches slow GPUs
PROM_FILE=${DYNPROF_PROM_FILE:-/var/lib/node_exporter/textfile_collector/dynprof_healthcheck.prom}
LOG_DIR=${DYNPROF_LOG_DIR:-/var/log/dynprof}
mkdir -p "$LOG_DIR"
report="$LOG_DIR/healthcheck-${SLURM_JOB_ID:-nojob}.json"

# SLURM_GPUS_ON_NODE (set for jobs that request GPUs) is the expected device count.
timeout 300 "$DYNPROF_PYTHON" -m dynprof healthcheck --level "$LEVEL" --json \
    --prometheus "$PROM_FILE" >"$report" 2>>"$LOG_DIR/healthcheck.stderr"
rc=$?

case $rc in
  0|1) exit 0 ;;
  3)
    if [ "${DYNPROF_STRICT:-0}" = 1 ]; then rc=2; else exit 0; fi ;;
  124) rc=2 ;;  # the healthcheck itself hung: the node is not fit either
esac

reason=$("$DYNPROF_PYTHON" - "$report" <<'PY' 2>/dev/null
import json, sys
try:
    r = json.load(open(sys.argv[1]))
    bad = [f"{c['name']}@{'node' if c['device'] is None else 'gpu' + str(c['device'])}"
           for c in r["checks"] if c["status"] == "fail"]
    print("dynprof healthcheck: " + (", ".join(bad[:6]) or r["verdict"]))
except Exception:
    print("dynprof healthcheck failed")
PY
)
scontrol update nodename="$(hostname -s)" state=drain reason="${reason:-dynprof healthcheck}"
exit 1
