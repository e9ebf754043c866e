#!/bin/bash
# dynprof's sidecar on every node of a Slurm job, so that `dynprof stacks --job J --hosts ...`
# and the web page reach every rank. Three ways, from the least set-up to the most:
#
# 1. No sidecar at all: one `dynprof` per node, through an extra step that overlaps the job's
#    own (run from a login node, or from inside the job; the output directory must be shared):
#
#      srun --jobid "$JOB" --overlap --ntasks-per-node=1 bash -c \
#        'dynprof stacks --job "$SLURM_JOB_ID" --json > "$HOME/dynprof-stacks/$(hostname -s).json"'
#      dynprof stacks --merge "$HOME"/dynprof-stacks/*.json     # one view of every rank
#
#    The same works for a trace started at one step on every node (pick the step yourself):
#      srun --jobid "$JOB" --overlap --ntasks-per-node=1 dynprof start --job "$JOB" --steps 5 --at-step 12000
#
# 2. A sidecar per node for the life of the job, started by the job script itself (this file,
#    `start` mode, as a step that overlaps the training step):
#
#      srun --overlap --ntasks-per-node=1 scripts/deploy/slurm_sidecar.sh start &
#      srun ... python train.py        # the training step, under `dynprof run` or DYNPROF=1
#
#    It ends with the job (Slurm kills the step).
#
# 3. A sidecar per node started by Slurm for every job: call this file from the Prolog and the
#    Epilog (slurm.conf: Prolog=/etc/slurm/prolog.d/*, Epilog=/etc/slurm/epilog.d/*):
#      prolog:  slurm_sidecar.sh prolog     (starts it as the job's user, detached, records its pid)
#      epilog:  slurm_sidecar.sh epilog     (stops it by that pid)
#
# The token: one file per user, mode 0600, on a shared home, the same on every node, given as
# DYNPROF_TOKEN_FILE (default ~/.config/dynprof/token; made on first use). Clients use the same
# file. The sidecar must run as the job's user: its agents answer only their own uid (or root)
# and keep their sockets in that user's run directory. GET /healthz answers "ok" without a token.

set -u
DYNPROF=${DYNPROF_BIN:-dynprof}
PORT=${DYNPROF_SIDECAR_PORT:-8787}
HOST=${DYNPROF_SIDECAR_HOST:-0.0.0.0}
THREADS=${DYNPROF_SIDECAR_THREADS:-8}
# the sidecar raises its soft open-file limit to this at start (within the hard limit: Slurm's
# default soft limit, 1024, would cap it at ~900 connections); it holds connections up to it,
# less 64 + 8 per thread, and sheds the rest
NOFILE=${DYNPROF_SIDECAR_NOFILE:-4096}

token_file_for() {  # $1: the user's home
  echo "${DYNPROF_TOKEN_FILE:-$1/.config/dynprof/token}"
}

ensure_token() {  # $1: token file; made with mode 0600 when missing
  if [ ! -s "$1" ]; then
    mkdir -p "$(dirname "$1")"
    (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$1.tmp.$$" && mv "$1.tmp.$$" "$1")
  fi
}

case "${1:-}" in
  start)
    token=$(token_file_for "$HOME")
    ensure_token "$token"
    exec "$DYNPROF" serve --host "$HOST" --port "$PORT" --threads "$THREADS" --max-open-files "$NOFILE" --token-file "$token"
    ;;
  prolog)
    user=${SLURM_JOB_USER:?prolog: SLURM_JOB_USER is not set}
    home=$(getent passwd "$user" | cut -d: -f6)
    token=$(token_file_for "$home")
    piddir=/run/dynprof-sidecar
    mkdir -p "$piddir" && chmod 0755 "$piddir"
    log="/tmp/dynprof-sidecar-${SLURM_JOB_ID:-0}.log"
    runuser -u "$user" -- bash -c "$(declare -f ensure_token); ensure_token '$token'"
    # detached from the prolog (setsid), as the job's user, its stderr (with its URL) kept private
    setsid runuser -u "$user" -- env DYNPROF_TOKEN_FILE="$token" bash -c \
      "umask 077; exec '$DYNPROF' serve --host '$HOST' --port '$PORT' --threads '$THREADS' --max-open-files '$NOFILE' --token-file '$token' 2>'$log'" \
      </dev/null >/dev/null 2>&1 &
    echo $! > "$piddir/${SLURM_JOB_ID:-0}.pid"
    exit 0   # never fail the job for the sidecar
    ;;
  epilog)
    pidfile=/run/dynprof-sidecar/${SLURM_JOB_ID:-0}.pid
    if [ -s "$pidfile" ]; then
      pid=$(cat "$pidfile")
      kill -TERM "$pid" 2>/dev/null   # the sidecar stops cleanly on SIGTERM
      for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -KILL "$pid" 2>/dev/null
      rm -f "$pidfile"
    fi
    exit 0
    ;;
  *)
    echo "usage: $0 start|prolog|epilog (see the comments at the top)" >&2
    exit 2
    ;;
esac
