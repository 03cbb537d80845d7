#!/usr/bin/env bash
# Launch `baton train` under torchrun, on one node or several.
#
#   launchers/torchrun.sh [--nproc N] -- --config configs/X.yaml [key=value ...]
#   launchers/torchrun.sh --nproc N --nnodes M --node-rank R --master-addr HOST [--master-port P] -- --config ...
#
# N defaults to the number of GPUs, or 1 on a CPU-only machine. On CPU, Baton uses gloo, and
# OMP_NUM_THREADS defaults to cores / N: ranks sharing a node's cores must not oversubscribe them.
# Multi-node: run the same command on every node with its own --node-rank (0 on the master).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}"
nproc="" nnodes=1 node_rank=0 master_addr="" master_port=29500
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) nproc="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "torchrun.sh: unknown option $1 (options go before --, baton train arguments after)" >&2; exit 2 ;;
  esac
done
if [ -z "$nproc" ]; then
  nproc="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nproc > 0 ? $(nproc) / nproc : 1 ))}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
if [ "$nnodes" = 1 ] && [ -z "$master_addr" ]; then
  rendezvous=(--standalone)  # one node: a free local port, no master to name
else
  [ -n "$master_addr" ] || { echo "torchrun.sh: --nnodes $nnodes needs --master-addr" >&2; exit 2; }
  rendezvous=(--nnodes "$nnodes" --node_rank "$node_rank" --master_addr "$master_addr" --master_port "$master_port")
fi
exec "$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$nproc" -m baton.common.cli train "$@"
