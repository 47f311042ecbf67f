"""`m2po sweep TARGET --status`: each run of a sweep's manifest with its state (Slurm's squeue/sacct, the run's
own record, or the local runner's) and its latest metrics."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Optional

from m2po_megatron.sweep.grid import find_manifest, last_metrics
from m2po_megatron.sweep.local import local_state


def _slurm_states(job_ids: list[str]) -> dict[str, str]:
    """State per job id (arrays as <id>_<task>) from squeue, then sacct when accounting is on."""
    states: dict[str, str] = {}
    if not job_ids:
        return states
    base = sorted({j.split("_")[0] for j in job_ids})
    try:
        res = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(base), "-o", "%i %T"],
                             capture_output=True, text=True, timeout=60)
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
    except (OSError, subprocess.TimeoutExpired):
        pass
    missing = [j for j in job_ids if j not in states]
    if missing:
        try:
            res = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(sorted({j.split('_')[0] for j in missing})),
                                  "-o", "JobID,State"], capture_output=True, text=True, timeout=60)
            if res.returncode == 0:
                for line in res.stdout.splitlines():
                    parts = line.split("|")
                    if len(parts) == 2 and parts[0] not in states:
                        states[parts[0]] = parts[1].split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return states


def _job_log_state(run_dir: Path) -> Optional[str]:
    """The run's own record (m2po.sbatch writes logs/job-state), for jobs Slurm has forgotten."""
    f = run_dir / "logs" / "job-state"
    if not f.is_file():
        return None
    lines = [ln.split() for ln in f.read_text().splitlines() if ln.strip()]
    if not lines:
        return None
    last = lines[-1]
    if last[0] == "EXIT":
        rc = last[-1].split("=")[-1]
        return "COMPLETED" if rc == "0" else f"FAILED(rc={rc})"
    return "ENDED?" if last[0] == "START" else last[0]


def status(target: str | Path) -> list[dict]:
    """One row per run: name, job id, state (Slurm's, or the local runner's record) and the latest metrics."""
    manifest = json.loads(find_manifest(target).read_text())
    runs = manifest["runs"]
    if manifest.get("mode") == "local":
        return [{"run": r["name"], "job": "local", "state": local_state(Path(r["run_dir"]), int(r["steps"])),
                 "run_dir": r["run_dir"], "steps": r["steps"], "metrics": last_metrics(Path(r["run_dir"]))}
                for r in runs]
    latest = {r["name"]: (r["jobs"][-1] if r["jobs"] else None) for r in runs}
    states = _slurm_states([j for j in latest.values() if j])
    rows = []
    for r in runs:
        job = latest[r["name"]]
        st = states.get(job) if job else None
        if st is None and job:  # a pending array task is listed as <id>_[0-3]; a done one not at all
            arr = job.split("_")[0]
            if any(k.startswith(arr + "_[") for k in states):
                st = "PENDING"
        run_dir = Path(r["run_dir"])
        st = st or _job_log_state(run_dir) or ("NOT SUBMITTED" if not job else "UNKNOWN")
        rows.append({"run": r["name"], "job": job, "state": st, "run_dir": str(run_dir),
                     "metrics": last_metrics(run_dir)})
    return rows


def format_status(rows: list[dict], keys: Optional[list[str]] = None) -> str:
    out = []
    for row in rows:
        m = row["metrics"] or {}
        shown = keys or [k for k in m if isinstance(m[k], (int, float)) and not isinstance(m[k], bool)][:6]
        ms = " ".join(f"{k}={m[k]:.4g}" if isinstance(m.get(k), float) else f"{k}={m.get(k)}"
                      for k in shown if k in m)
        progress = f"step {m.get('step', 0)}/{row['steps']}" if row.get("steps") else ""
        out.append(f"{row['run']:<40} {str(row['job']):<12} {row['state']:<16} {progress:<14} {ms or '-'}")
    return "\n".join(out)
