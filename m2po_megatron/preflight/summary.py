"""The preflight's report: one JSON document (every check's status, numbers, cause and fix) and the table
printed for a person. The exit code follows the statuses: 0 when no check failed (skipped ones do not count),
1 otherwise. Pure: no check runs here."""
from __future__ import annotations

import json
from typing import Sequence

from m2po_megatron.preflight.checks import Result

SCHEMA = 1


def exit_code(results: Sequence[Result]) -> int:
    return 1 if any(r.status == "fail" for r in results) else 0


def document(results: Sequence[Result], *, recipe: str | None, device: str, ray_address: str | None) -> dict:
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "fail", "skipped")}
    return {"schema": SCHEMA, "recipe": recipe, "device": device, "ray_address": ray_address,
            "passed": exit_code(results) == 0, "counts": counts, "checks": [r.to_dict() for r in results]}


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


def _numbers(numbers: dict, width: int = 70) -> str:
    """The first few measured numbers, short: floats with 3 significant digits, lists and dicts left out."""
    parts = []
    for k, v in numbers.items():
        if isinstance(v, bool) or v is None:
            parts.append(f"{k}={v}")
        elif isinstance(v, float):
            parts.append(f"{k}={v:.3g}")
        elif isinstance(v, int) or (isinstance(v, str) and len(v) <= 30):  # no paths: they are in the JSON
            parts.append(f"{k}={v}")
    text = ", ".join(parts)
    return text if len(text) <= width else text[:width - 3] + "..."


def table(results: Sequence[Result]) -> str:
    """One row per check (status, seconds of its limit, the numbers), then the cause and fix of each failure
    and the reason of each skip, then the verdict."""
    rows = [("check", "status", "time", "measured")]
    rows += [(r.name, r.status.upper() if r.status == "fail" else r.status, f"{r.seconds:.0f}/{r.limit_s:.0f} s",
              _numbers(r.numbers)) for r in results]
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}".rstrip() for a, b, c, d in rows]
    lines.insert(1, "-" * (sum(w) + 6 + max(len(row[3]) for row in rows)))
    for r in results:
        if r.status == "fail":
            lines += [f"{r.name}: FAILED: {r.cause}", f"{' ' * len(r.name)}  fix: {r.fix}"]
        elif r.status == "skipped":
            lines.append(f"{r.name}: skipped: {r.cause}")
    failed = [r.name for r in results if r.status == "fail"]
    lines.append(f"preflight: {'FAILED (' + ', '.join(failed) + ')' if failed else 'passed'}: "
                 f"{sum(r.status == 'ok' for r in results)} ok, {len(failed)} failed, "
                 f"{sum(r.status == 'skipped' for r in results)} skipped")
    return "\n".join(lines)
