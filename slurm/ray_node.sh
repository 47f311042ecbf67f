#!/usr/bin/env bash
# ray_node.sh head|worker - start one Ray node of the job's cluster, in the foreground (--block), so the
# job step lives exactly as long as this node's Ray processes. Run by m2po.sbatch through `srun`.
#
# The node's role decides its Ray custom resources (docs/cluster.md, "Ray resources"):
#   trainer nodes  -> {"trainer": SLOTS}             rollout nodes -> {"rollout": SLOTS}
#   colocated      -> {"trainer": SLOTS, "rollout": SLOTS}
# SLOTS = GPUs on the node, or Ray's CPU count on a CPU-only node. Every node also gets
# {"m2po_node_<rank>": 1} so a caller can pin an actor to one node of the job.
# Inputs (exported by m2po.sbatch): M2PO_RAY_HEAD_IP, M2PO_RAY_PORT, M2PO_PORT_BASE, M2PO_TRAINER_NODES,
# M2PO_ROLLOUT_NODES (space-separated Slurm node names), M2PO_RAY_TMPDIR, optional M2PO_RAY_CPUS,
# M2PO_RAY_OBJECT_STORE_BYTES, M2PO_RAY_EXTRA (more `ray start` flags), M2PO_RAY (the ray executable).
set -euo pipefail
role=$1
node=${SLURMD_NODENAME:-$(hostname -s)}
# a routable address of this node: M2PO_NODE_IP_CMD lets a cluster pick the right interface
ip=$(${M2PO_NODE_IP_CMD:-hostname --ip-address} | awk '{print $1}')
rank=0
for n in $M2PO_ALL_NODES; do [ "$n" = "$node" ] && break; rank=$((rank + 1)); done

cpus=${M2PO_RAY_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
gpus=0
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != "NoDevFiles" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
elif command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
slots=$gpus; [ "$slots" -gt 0 ] || slots=$cpus

res="\"m2po_node_$rank\": 1"
case " $M2PO_TRAINER_NODES " in *" $node "*) res="$res, \"trainer\": $slots";; esac
case " $M2PO_ROLLOUT_NODES " in *" $node "*) res="$res, \"rollout\": $slots";; esac
resources="{$res}"

# per-job, per-node ports: nodes of a test cluster on one machine share a port space, and two jobs can
# share a real node; PORT_BASE is the job's block, rank picks a sub-block
pb=$((M2PO_PORT_BASE + 10 + 6 * (rank % 15)))
tmp=$M2PO_RAY_TMPDIR/$node   # node-local temp dir (sockets, logs); kept short: AF_UNIX paths <= 107 bytes
mkdir -p "$tmp"
common=(--node-ip-address="$ip" --temp-dir="$tmp" --num-cpus="$cpus" --resources="$resources"
        --node-manager-port=$((pb + 0)) --object-manager-port=$((pb + 1))
        --dashboard-agent-listen-port=$((pb + 2)) --dashboard-agent-grpc-port=$((pb + 3))
        --metrics-export-port=$((pb + 4)) --runtime-env-agent-port=$((pb + 5))
        --disable-usage-stats --block)
[ -n "${M2PO_RAY_OBJECT_STORE_BYTES:-}" ] && common+=(--object-store-memory="$M2PO_RAY_OBJECT_STORE_BYTES")
# shellcheck disable=SC2206
[ -n "${M2PO_RAY_EXTRA:-}" ] && common+=($M2PO_RAY_EXTRA)
echo "[ray_node] $role node=$node rank=$rank ip=$ip cpus=$cpus gpus=$gpus resources=$resources tmp=$tmp"
export RAY_TMPDIR=$tmp
RAY=${M2PO_RAY:-ray}
if [ "$role" = head ]; then
  cmd=($RAY start --head --port="$M2PO_RAY_PORT" --ray-client-server-port=$((M2PO_PORT_BASE + 1)) --include-dashboard=false)
else
  cmd=($RAY start --address="$M2PO_RAY_HEAD_IP:$M2PO_RAY_PORT")
fi
# A start that fails before the whole cluster is up (e.g. Ray's agents too slow on an overloaded node)
# is retried; once m2po.sbatch has marked the cluster up, any exit is final and ends the job.
up=${M2PO_RAY_UP_MARKER:-/nonexistent}
attempts=${M2PO_RAY_START_ATTEMPTS:-3}
rc=0
for attempt in $(seq 1 "$attempts"); do
  "${cmd[@]}" "${common[@]}" && rc=0 || rc=$?
  [ -e "$up" ] && exit "$rc"
  echo "[ray_node] ray start ended with $rc before the cluster was up (attempt $attempt/$attempts)"
  sleep 2
done
exit "$rc"
