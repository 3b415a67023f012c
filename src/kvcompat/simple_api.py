"""The package index's simple API: the two reads kvcompat makes itself.

Which releases of a project exist (for matrix ranges, release checks and
bisect), and where a release's sdist is (for the upstream suite).  The index is
the one uv resolves cells against, so the two always agree.  PEP 691 JSON is
asked for, PEP 503 HTML is understood too.

Stdlib only.  The index's root URL is given by the caller (see kvcompat.options).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request


def http_get(url: str, *, accept: str | None = None, timeout: float = 120.0, attempts: int = 2) -> bytes:
    """GET ``url``, retried once after 2 s (index hiccups are common)."""
    headers = {"User-Agent": "kvcompat"}
    if accept:
        headers["Accept"] = accept
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
                return resp.read()
        except OSError:
            if attempt + 1 == attempts:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def project_files(base: str, project: str) -> list[dict]:
    """The files of ``project`` on the index at ``base``: dicts with filename, absolute url,
    sha256 (or None), yanked and upload_time (PEP 700's ``upload-time``; None from HTML pages)."""
    page_url = f"{base.rstrip('/')}/{project}/"
    page = http_get(page_url, accept="application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    try:
        raw = [
            (
                f["filename"],
                f["url"],
                (f.get("hashes") or {}).get("sha256"),
                bool(f.get("yanked")),
                f.get("upload-time"),
            )
            for f in json.loads(page)["files"]
        ]
    except (ValueError, KeyError, TypeError):  # PEP 503 HTML: <a href="url#sha256=…" data-yanked>filename</a>
        raw = []
        for m in re.finditer(r'<a([^>]*)href=(["\'])([^"\']+)\2([^>]*)>', page.decode(errors="replace")):
            href, _, fragment = m.group(3).partition("#")
            sha = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
            raw.append((href.rsplit("/", 1)[-1], href, sha, "data-yanked" in m.group(1) + m.group(4), None))
    return [
        {
            "filename": name,
            "url": urllib.request.urljoin(page_url, url).split("#")[0],
            "sha256": sha,
            "yanked": yanked,
            "upload_time": uploaded,
        }
        for name, url, sha, yanked, uploaded in raw
    ]
