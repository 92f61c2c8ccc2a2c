#!/usr/bin/env bash
# Starts N processes of one multi-process job on this machine, all running the same command.
#
#   launch/local.sh N COMMAND...
#   launch/local.sh 2 python -m jaxrlhf.train --config=configs/ppo_tiny.py --workdir=/tmp/run
#
# Each process gets JAXRLHF_COORDINATOR_ADDRESS (a free port on 127.0.0.1), JAXRLHF_NUM_PROCESSES
# and JAXRLHF_PROCESS_ID, which `python -m jaxrlhf.train` reads (jaxrlhf/distributed.py).
# On the CPU backend the config's cpu_devices are split evenly over the processes, so
# `launch/local.sh 2 ...` with cpu_devices=8 runs 2 processes x 4 devices.
# GPUs: set GPUS_PER_PROCESS=K to give process i the local devices i*K .. i*K+K-1.
#
# Process 0 writes to this terminal; process i>0 writes to $LOG_DIR/process_i.log (default: a
# new temporary directory) and its error lines are echoed here with a "[process i]" prefix.
# When a process exits non-zero the others stop by themselves within the heartbeat timeout
# (jax.distributed); whatever is left after GRACE_S seconds (default 90) is killed. The exit
# code is the first non-zero one, naming the process that failed first.
#
# Stopping: SIGINT (Ctrl-C), SIGTERM or SIGUSR1 to this script asks every process to finish its
# step, save a checkpoint and exit (`launch/slurm.sbatch` runs one-node jobs through here). Only
# the first such signal is passed on, and as a kind the processes cannot have received
# themselves: Ctrl-C reaches them too (SIGINT), and so does Slurm's SIGTERM when it cancels the
# job or signals all of it, and a second signal of the same kind tells them to stop at once,
# unsaved. So SIGINT is passed on as SIGTERM, SIGTERM and SIGUSR1 as SIGINT, which Slurm never
# sends. Processes still running STOP_GRACE_S seconds (default 170) after that are killed: one
# that hangs must not keep its job (and its machines) forever.
set -u

if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES COMMAND..." >&2
  exit 2
fi
num=$1
shift
grace=${GRACE_S:-90}
log_dir=${LOG_DIR:-$(mktemp -d -t jaxrlhf-local-XXXXXX)}
mkdir -p "$log_dir"
# The coordinator's port stays reserved while the job runs: a port picked and released could be
# taken meanwhile by another job's SO_REUSEPORT server and silently shared (see reserve_port in
# jaxrlhf/distributed.py). The holder binds it with SO_REUSEPORT and never listens.
# `exec`: the coprocess *is* the holder, so that killing it at exit frees the port (killing a
# subshell around it would leave it running, holding the port and this script's stderr).
coproc PORT_HOLDER { exec python3 -c 'import signal, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", 0)); print(s.getsockname()[1], flush=True); signal.pause()' 2>/dev/null; }
holder=$PORT_HOLDER_PID
read -r port <&"${PORT_HOLDER[0]}"
trap 'kill "$holder" 2>/dev/null' EXIT

declare -A proc_of  # pid -> process index
pids=()
for ((i = 0; i < num; i++)); do
  env=(JAXRLHF_COORDINATOR_ADDRESS="127.0.0.1:$port" JAXRLHF_NUM_PROCESSES="$num"
       JAXRLHF_PROCESS_ID="$i")
  if [[ -n "${GPUS_PER_PROCESS:-}" ]]; then
    ids=$(seq -s, $((i * GPUS_PER_PROCESS)) $(((i + 1) * GPUS_PER_PROCESS - 1)))
    env+=(JAX_LOCAL_DEVICE_IDS="$ids")
  fi
  if ((i == 0)); then
    env "${env[@]}" "$@" &
  else
    env "${env[@]}" "$@" >"$log_dir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
  proc_of[$!]=$i
done
((num > 1)) && echo "local.sh: $num processes (coordinator 127.0.0.1:$port); logs of" \
  "processes 1-$((num - 1)) in $log_dir" >&2

start_timer() {  # VAR SECONDS: VAR = the pid of a process that ends SECONDS from now. It is
  # deaf to the signals that stop the job (Slurm sends them to every process of the job), so
  # only SIGKILL ends it early; it holds none of this script's output (a caller reading that
  # to its end would wait for the timer).
  (trap '' INT TERM USR1; exec sleep "$2") </dev/null >/dev/null 2>&1 &
  printf -v "$1" %s "$!"
}

status=0
live=("${pids[@]}")
timer=""       # runs GRACE_S from the first failure
stop_timer=""  # runs STOP_GRACE_S from the stop request
stopping=0
stop() {  # $1: the signal to pass on (see the header)
  ((stopping)) && return
  stopping=1
  echo "local.sh: asking every process to save a checkpoint and exit (SIG$1)" >&2
  kill -"$1" "${live[@]}" 2>/dev/null
  start_timer stop_timer "${STOP_GRACE_S:-170}"
}
trap 'stop TERM' INT
trap 'stop INT' TERM USR1

while ((${#live[@]} > 0)); do
  finished=""
  wait -n -p finished "${live[@]}" $timer $stop_timer
  code=$?
  # Interrupted by a trap (a stop request): `wait -p` leaves `finished` unset.
  [[ -z "${finished:-}" ]] && continue
  if [[ "$finished" == "$timer" || "$finished" == "$stop_timer" ]]; then
    why="${grace}s after the first failure"
    [[ "$finished" == "$stop_timer" ]] && why="${STOP_GRACE_S:-170}s after the stop request"
    echo "local.sh: killing the processes still running $why" >&2
    kill -KILL "${live[@]}" 2>/dev/null
    [[ "$finished" == "$timer" ]] && timer="" || stop_timer=""
    continue
  fi
  live=($(printf '%s\n' "${live[@]}" | grep -vx "$finished"))
  i=${proc_of[$finished]}
  if ((code != 0)); then
    reason="exit code $code"
    ((code > 128)) && reason="$reason, signal $((code - 128))"
    echo "local.sh: process $i (pid $finished) failed ($reason)" >&2
    if ((i > 0)); then
      grep -E "^(error|jaxrlhf|Traceback|[A-Za-z]+Error)" "$log_dir/process_$i.log" \
        | tail -n 5 | sed "s/^/[process $i] /" >&2
    fi
    if ((status == 0)); then
      status=$code
      start_timer timer "$grace"
    fi
  fi
done
for t in $timer $stop_timer; do kill -KILL "$t" 2>/dev/null; done
exit "$status"
