#!/usr/bin/env bash
# Launch `baton train` with DeepSpeed's launcher, on one node or several (pass backend=deepspeed
# and deepspeed.* keys in the recipe or as overrides).
#
#   launchers/deepspeed.sh [--nproc N] -- --config configs/zero2_cpu_offload.yaml [key=value ...]
#   launchers/deepspeed.sh --hostfile HOSTS --master-addr HOST [--master-port P] -- --config ...
#
# On CPU the deepspeed launcher starts one rank unless told the slot count: on one node this sets
# LOCAL_SIZE=N (what DeepSpeed's CPU accelerator reports as its device count); N defaults to the
# number of GPUs, or 1 on CPU. A multi-node HOSTS file lists `hostname slots=N` per node, and
# DeepSpeed reaches the nodes with pdsh/ssh (under SLURM, launchers/deepspeed.sbatch needs neither:
# srun starts the ranks).
# On CPU, Baton uses gloo; OMP_NUM_THREADS defaults to cores / N.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}"
nproc="" hostfile="" master_addr="127.0.0.1" master_port=29500
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) nproc="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "deepspeed.sh: unknown option $1 (options go before --, baton train arguments after)" >&2; exit 2 ;;
  esac
done
if [ -n "$hostfile" ]; then
  where=(--hostfile "$hostfile" --master_addr "$master_addr")
  slots="$(awk '/slots=/ {sub(/.*slots=/, ""); print $1; exit}' "$hostfile")"
else
  [ -n "$nproc" ] || nproc="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')"
  export LOCAL_SIZE="$nproc"
  where=(--num_gpus "$nproc")
  slots="$nproc"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / slots > 0 ? $(nproc) / slots : 1 ))}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
# --no_local_rank: Baton reads LOCAL_RANK from the environment, not a --local_rank argument.
exec "$PYTHON" -m deepspeed.launcher.runner "${where[@]}" --master_port "$master_port" --no_local_rank \
  --module baton.common.cli train "$@"
