# container.sh - sourced by m2po.sbatch: how each command of the job enters the image (docs/container.md).
#
#   M2PO_CONTAINER=IMAGE            unset: no container (the default; M2PO_SRUN_ARGS / M2PO_EXEC still apply)
#   M2PO_CONTAINER_RUNTIME=pyxis|apptainer   default: apptainer for a *.sif IMAGE, pyxis otherwise
#   M2PO_CONTAINER_MOUNTS=SRC[:DST],...      more bind mounts (models, data, HF cache), both runtimes
#
# pyxis (enroot): IMAGE is a squashfs file (enroot import) or a registry reference; every srun gets
# --container-image/--container-mounts, and a job-scoped --container-name so that steps after the first on a
# node reuse the unpacked image. The batch shell itself stays outside (it needs srun and scontrol), so its own
# helpers (the layout, the Ray health checks) run as a one-task srun step on the first node.
# apptainer: every command, helpers included, is prefixed with `apptainer exec --nv --bind ... IMAGE`.
# Either way the checkout (M2PO_HOME), the run directory and the Ray temp root are mounted at the same paths,
# and PYTHONPATH puts the checkout first, so the image's copy of m2po_megatron is not the one that runs.

# m2po_container_setup HEAD PATH... : sets CONTAINER_SRUN (srun arguments), CONTAINER_EXEC (a command prefix)
# and HELPER (the prefix of commands the batch shell runs itself); PATHs are mounted besides the user's.
m2po_container_setup() {
  local head=$1; shift
  CONTAINER_SRUN=(); CONTAINER_EXEC=(); HELPER=("${EXEC[@]}")
  [ -n "${M2PO_CONTAINER:-}" ] || return 0
  local runtime=${M2PO_CONTAINER_RUNTIME:-}
  if [ -z "$runtime" ]; then
    case "$M2PO_CONTAINER" in *.sif) runtime=apptainer;; *) runtime=pyxis;; esac
  fi
  local mounts="" p
  for p in "$@"; do
    [ -n "$p" ] || continue
    case ",$mounts," in *",$p:$p,"*) continue;; esac
    mounts=${mounts:+$mounts,}$p:$p
  done
  [ -n "${M2PO_CONTAINER_MOUNTS:-}" ] && mounts=${mounts:+$mounts,}$M2PO_CONTAINER_MOUNTS
  case "$runtime" in
    pyxis)
      CONTAINER_SRUN=(--container-image="$M2PO_CONTAINER" --container-mounts="$mounts"
                      --container-workdir="$M2PO_HOME" --container-name="m2po-${SLURM_JOB_ID:-0}")
      HELPER=(srun --overlap -N1 -n1 -w "$head" "${SRUN_EXTRA[@]}" "${CONTAINER_SRUN[@]}" "${EXEC[@]}")
      ;;
    apptainer|singularity)
      CONTAINER_EXEC=("$runtime" exec --nv --bind "$mounts" "$M2PO_CONTAINER")
      HELPER=("${EXEC[@]}" "${CONTAINER_EXEC[@]}")
      ;;
    *)
      echo "M2PO_CONTAINER_RUNTIME=$runtime: use pyxis or apptainer" >&2
      return 2
      ;;
  esac
}
