"""Tiny synchronous HTTP helpers for the control plane (health checks, weight-sync calls) outside asyncio."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def request(url: str, body: dict | None = None, *, api_key: str | None = None, timeout: float = 30.0,
            method: str | None = None) -> tuple[int, str]:
    """(status, text); connection problems raise OSError (URLError is one)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"))
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post_ok(url: str, body: dict, *, api_key: str | None = None, timeout: float = 600.0) -> dict:
    """POST and require HTTP 200 and, when present, success=true; raise RuntimeError with the server's text."""
    status, text = request(url, body, api_key=api_key, timeout=timeout)
    try:
        out = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        out = {"message": text}
    if status != 200 or (isinstance(out, dict) and out.get("success") is False):
        raise RuntimeError(f"{url} answered {status}: {text[:500]}")
    return out if isinstance(out, dict) else {"result": out}
