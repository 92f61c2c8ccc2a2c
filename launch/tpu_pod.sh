#!/usr/bin/env bash
# One jaxrlhf job on a Cloud TPU pod slice: the same command on every TPU VM worker.
#
#   TPU_NAME=my-v5p-128 ZONE=us-east5-a launch/tpu_pod.sh setup
#   TPU_NAME=my-v5p-128 ZONE=us-east5-a launch/tpu_pod.sh run \
#       --config=configs/ppo_70b.py --workdir=/mnt/shared/runs/ppo_70b
#   TPU_NAME=my-v5p-128 ZONE=us-east5-a launch/tpu_pod.sh --dry-run run FLAGS...
#
# setup copies this checkout to every worker and installs it. run starts
# `python -m jaxrlhf.train FLAGS...` on every worker at once, worker i as process i of N (N
# workers: 16 on a v5p-128), with worker 0 as the coordinator (its internal address, port
# COORDINATOR_PORT, default 8476); the workers' internal addresses come from
# `gcloud compute tpus tpu-vm describe`, or from WORKER_IPS ("10.0.0.2 10.0.0.3 ...", worker 0
# first). --dry-run prints the command each worker would run, one line each, and runs nothing.
# --workdir must be a directory every worker reaches, e.g. a Filestore NFS mount. Only process
# 0 prints progress; the others print errors only. Each worker also keeps its output in
# ~/jaxrlhf-run.log. The exit code is the first non-zero one of the workers.
set -euo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
project=()
[[ -n "${PROJECT:-}" ]] && project=(--project "$PROJECT")
remote_dir=${REMOTE_DIR:-jaxrlhf}
port=${COORDINATOR_PORT:-8476}

run() {  # prints the command under --dry-run (as a shell reads it), else runs it
  if ((dry_run)); then
    local word words=()
    for word in "$@"; do
      [[ "$word" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]] || word="'${word//\'/\'\\\'\'}'"
      words+=("$word")
    done
    echo "${words[*]}"
  else
    "$@"
  fi
}

ssh_worker() {  # WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${project[@]}" \
    --worker="$1" --command "$2"
}

worker_ips() {
  if [[ -n "${WORKER_IPS:-}" ]]; then
    echo "${WORKER_IPS//,/ }"
    return
  fi
  gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" "${project[@]}" \
    --format='value(networkEndpoints[].ipAddress)' | tr ';,' '  '
}

case "${1:-}" in
  setup)
    repo=$(cd "$(dirname "$0")/.." && pwd)
    run tar -C "$repo" --exclude=.git -czf /tmp/jaxrlhf.tgz .
    run gcloud compute tpus tpu-vm scp /tmp/jaxrlhf.tgz "$TPU_NAME":/tmp/jaxrlhf.tgz \
      --zone "$ZONE" "${project[@]}" --worker=all
    ssh_worker all "mkdir -p $remote_dir && tar -C $remote_dir -xzf /tmp/jaxrlhf.tgz && \
cd $remote_dir && pip install -q -e . 'jax[tpu]'"
    ;;
  run)
    shift
    read -r -a ips <<<"$(worker_ips)"
    if ((${#ips[@]} == 0)); then
      echo "error: no worker addresses for $TPU_NAME (set WORKER_IPS)" >&2
      exit 2
    fi
    flags=$(printf ' %q' "$@")
    pids=()
    for i in "${!ips[@]}"; do
      env="JAXRLHF_COORDINATOR_ADDRESS=${ips[0]}:$port JAXRLHF_NUM_PROCESSES=${#ips[@]}"
      env+=" JAXRLHF_PROCESS_ID=$i"
      ssh_worker "$i" "set -o pipefail; cd $remote_dir && $env python -m jaxrlhf.train$flags \
2>&1 | tee ~/jaxrlhf-run.log" &
      pids+=($!)
      ((dry_run)) && wait "$!"  # the lines in worker order
    done
    status=0
    for pid in "${pids[@]}"; do
      wait "$pid" && code=0 || code=$?
      ((status == 0)) && status=$code
    done
    exit "$status"
    ;;
  *)
    echo "usage: $0 [--dry-run] setup | run --config=CONFIG --workdir=SHARED_DIR [FLAGS...]" >&2
    exit 2
    ;;
esac
