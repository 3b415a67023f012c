"""Helpers shared by the harness tests: fake vLLM wheels and projects, the front doors, results, an index."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import CellResult, TestResult

REPO = Path(__file__).resolve().parents[2]


def build_wheel(
    folder: Path, files: dict[str, str], *, name: str = "vllm", version: str = "0.0.1", requires: list[str] = ()
) -> Path:
    """Write a minimal valid wheel of ``name`` containing ``files`` (path -> source)."""
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    entries = {
        **files,
        f"{dist_info}/METADATA": meta,
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvcompat-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record_lines = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(text.encode())}")
    record_lines.append(f"{dist_info}/RECORD,,")
    wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in entries.items():
            zf.writestr(path, text)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(record_lines) + "\n")
    return wheel


FAKE_CONNECTOR_FILES = {
    "vllm/__init__.py": "__version__ = '0.0.1'\n",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/kv_transfer/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py": "def first_wins(children):\n    return next(i for i, c in enumerate(children) if c)\n",
}


def build_project(
    root: Path,
    suite: str,
    versions: tuple[str, ...] = ("0.0.1", "0.0.2"),
    files: dict[str, dict[str, str]] | None = None,
) -> Path:
    """A throwaway kvcompat project: our noxfile and src, ``suite`` as tests/connectors, and a
    default matrix of fake vLLM wheels (one folder per version, all also in wheels/house).
    ``files`` replaces files of some versions' wheels: {version: {path: source}}."""
    import shutil

    repo = REPO
    (root / "tests" / "connectors").mkdir(parents=True)
    (root / "constraints").mkdir()
    shutil.copy(repo / "noxfile.py", root / "noxfile.py")
    (root / "src").symlink_to(repo / "src")
    (root / "tests" / "connectors" / "test_suite.py").write_text(suite)
    house = root / "wheels" / "house"
    house.mkdir(parents=True)
    wheels = []
    for v in versions:
        wheel_files = {**FAKE_CONNECTOR_FILES, "vllm/__init__.py": f"__version__ = {v!r}\n", **(files or {}).get(v, {})}
        folder = root / "wheels" / v
        folder.mkdir(parents=True)
        wheels.append(build_wheel(folder, wheel_files, version=v))
        shutil.copy(wheels[-1], house / wheels[-1].name)
    entries = ", ".join(f'{{ vllm = "wheels/{w.parent.name}/{w.name}" }}' for w in wheels)
    (root / "pyproject.toml").write_text(f"[tool.kvcompat.matrix]\ndefault = [{entries}]\n")
    return root


# Fake cells need a few MB: the harness tests are about other faults than a disk short of a
# real cell's 15 GiB (conftest exports it as KVCOMPAT_MIN_FREE_GB for the nox runs they start).
SMALL_CELL_GB = "0.1"


# -- running the front doors ---------------------------------------------------------------


def nox_command(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "nox", "-f", str(root / "noxfile.py"), *args]


def run_nox(root: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run real nox on the project at ``root`` and wait for it."""
    return subprocess.run(
        nox_command(root, *args),
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The contract for bad input: exit status 2, no traceback, exactly one ``kvcompat: error:`` line."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvcompat: error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


# -- results -----------------------------------------------------------------------------------


def make_result(
    vllm: str = "0.30.0",
    torch: str = "2.13.0",
    outcome: Outcome = Outcome.PASS,
    tests=(),
    detail: str = "",
    *,
    suite: str = "ours",
    prefix: str = "tests/connectors/test_multi.py::",
    **kw,
) -> CellResult:
    """A CellResult as a cell run writes it; ``tests`` are (name, outcome, message) triples.

    Keywords naming a CellResult field (detail, finished, suites, versions, …) set it; the rest go to the Cell.
    """
    fields = {f.name for f in dataclasses.fields(CellResult)}
    given = {k: v for k, v in kw.items() if k in fields}
    cell_kw = {k: v for k, v in kw.items() if k not in fields}
    result = {
        "detail": detail,
        "finished": "2026-12-02T10:00:00+00:00",
        "phases": {"resolve": 1.0, "test": 2.0},
        **given,
    }
    return CellResult(
        cell=Cell(vllm=vllm, torch=torch, **cell_kw),
        outcome=outcome,
        tests=[TestResult(f"{prefix}{n}", TestOutcome(o), 0.5, m, suite) for n, o, m in tests],
        **result,
    )


# -- a package index -----------------------------------------------------------------------------


def file_index(folder: Path, wheels: list[Path]) -> str:
    """A PEP 503 simple index of ``wheels`` under ``folder``, as a file:// URL uv resolves against."""
    by_project: dict[str, list[Path]] = {}
    for wheel in wheels:
        by_project.setdefault(wheel.name.split("-")[0].replace("_", "-").lower(), []).append(wheel)
    for project, files in by_project.items():
        page = folder / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        (page / "index.html").write_text("".join(f'<a href="{w.resolve().as_uri()}">{w.name}</a>\n' for w in files))
    return (folder / "simple").resolve().as_uri()


class FakeIndex:
    """Stands in for ``simple_api.http_get``: one project's simple-API page (PEP 691 JSON or PEP 503
    HTML) under ``base``, and the bodies of its files under ``<host>/files/``.

    ``files`` are (filename, body or None, yanked[, upload time]); a ``sha`` given replaces every file's hash.
    """

    def __init__(
        self,
        files,
        *,
        project: str = "vllm",
        html: bool = False,
        sha: str | None = None,
        base: str = "https://idx.example/simple",
    ) -> None:
        self.files = [(f[0], f[1], f[2], f[3] if len(f) > 3 else None) for f in files]
        self.project, self.html, self.sha, self.base = project, html, sha, base.rstrip("/")
        self.calls: list[tuple[str, str | None]] = []

    @property
    def urls(self) -> list[str]:
        return [url for url, _ in self.calls]

    def file_url(self, name: str) -> str:
        return self.base.rsplit("/", 1)[0] + f"/files/{name}"

    def _hash(self, body: bytes | None) -> str | None:
        return self.sha or (hashlib.sha256(body).hexdigest() if body is not None else None)

    def __call__(self, url: str, *, accept: str | None = None, **_) -> bytes:
        self.calls.append((url, accept))
        if url == f"{self.base}/{self.project}/":
            if self.html:
                return "".join(
                    f'<a href="../../files/{n}{"#sha256=" + h if (h := self._hash(b)) else ""}"'
                    f"{' data-yanked' if y else ''}>{n}</a>"
                    for n, b, y, _ in self.files
                ).encode()
            return json.dumps(
                {
                    "meta": {"api-version": "1.1"},
                    "name": self.project,
                    "files": [
                        {
                            "filename": n,
                            "url": f"../../files/{n}",
                            "hashes": {"sha256": h} if (h := self._hash(b)) else {},
                            "yanked": y,
                            **({"upload-time": up} if up else {}),
                        }
                        for n, b, y, up in self.files
                    ],
                }
            ).encode()
        for name, body, _, _ in self.files:
            if url == self.file_url(name) and body is not None:
                return body
        raise OSError(f"404 {url}")


class IndexServer:
    """A simple index over HTTP on 127.0.0.1, for what a file:// URL cannot show: a real HTTP client and server.

    ``folder`` is served as files (``simple/<project>/index.html`` as :func:`file_index` writes it).
    ``cut_after`` (bytes, or None) makes every ``.whl`` response promise its whole length and close the
    connection after that many bytes: a download cut mid-wheel.  Other projects' pages (pytest and its
    dependencies) are redirected to ``upstream``, whose file URLs are absolute.
    """

    def __init__(self, folder: Path, *, upstream: str = "https://pypi.org/simple", cut_after: int | None = None):
        self.folder, self.upstream, self.cut_after = folder, upstream.rstrip("/"), cut_after
        self.cuts: list[str] = []  # paths whose download was cut

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"

    def __enter__(self) -> IndexServer:
        import http.server
        import threading

        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kw):
                super().__init__(*args, directory=str(server.folder), **kw)

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                local = server.folder / self.path.lstrip("/").split("?")[0]
                if self.path.startswith("/simple/") and not local.exists():
                    self.send_response(302)
                    self.send_header("Location", server.upstream + self.path.removeprefix("/simple"))
                    self.end_headers()
                    return
                if self.path.endswith(".whl") and server.cut_after is not None and local.is_file():
                    body = local.read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: server.cut_after])
                    self.wfile.flush()
                    server.cuts.append(self.path)
                    self.close_connection = True
                    return
                super().do_GET()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def http_index(folder: Path, wheels: list[Path]) -> None:
    """A PEP 503 index of ``wheels`` under ``folder`` with relative links (and PEP 658 metadata), for IndexServer."""
    import shutil

    by_project: dict[str, list[Path]] = {}
    for wheel in wheels:
        by_project.setdefault(wheel.name.split("-")[0].replace("_", "-").lower(), []).append(wheel)
    files = folder / "files"
    files.mkdir(parents=True, exist_ok=True)
    for project, found in by_project.items():
        page = folder / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        links = []
        for wheel in found:
            shutil.copy(wheel, files / wheel.name)
            with zipfile.ZipFile(wheel) as zf:
                meta = next(zf.read(n) for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            (files / f"{wheel.name}.metadata").write_bytes(meta)
            sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
            meta_sha = hashlib.sha256(meta).hexdigest()
            links.append(
                f'<a href="../../files/{wheel.name}#sha256={sha}" data-dist-info-metadata="sha256={meta_sha}" '
                f'data-core-metadata="sha256={meta_sha}">{wheel.name}</a>\n'
            )
        (page / "index.html").write_text("".join(links))


def default_cell_venv(which: Callable[[dict], bool]) -> Path:
    """The venv of the first default-matrix entry ``which`` picks (its nixl-first cell), built with
    ``nox -s matrix -k "vllm_X and not torch_Y" -- --force`` (uv, from its cache) when it is missing."""
    default = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["kvcompat"]["matrix"]["default"]
    entry = next(e for e in default if which(e))
    prefix = f"{entry.get('dist', 'vllm')}-{entry['vllm']}__"
    # The same release may have other entries with a torch of their own (the next-torch cell):
    # neither built nor picked here.
    others = {
        e["torch"]
        for e in default
        if e is not entry and e["vllm"] == entry["vllm"] and e.get("dist") == entry.get("dist") and "torch" in e
    }
    others.discard(entry.get("torch"))
    expression = " and ".join(
        ["vllm_" + entry["vllm"].replace(".", "_")] + [f"not torch_{t.replace('.', '_')}" for t in sorted(others)]
    )
    venvs = REPO / ".kvcompat" / "venvs"

    def found() -> list[Path]:
        return [
            p
            for p in sorted(venvs.glob(prefix + "*"))
            if p.is_dir()
            and "offload-first" not in p.name
            and not any(f"__torch-{t}" in p.name for t in others)
            and (p / "bin" / "python").exists()
        ]

    if not found():
        proc = subprocess.run(
            nox_command(REPO, "-s", "matrix", "-k", expression, "--", "--force"),
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert found(), f"could not build the {expression} cell: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return found()[0]
