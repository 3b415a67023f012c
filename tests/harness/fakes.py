"""Fake vLLM wheels for harness tests: real wheel files with a tiny stand-in package."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


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


def build_project(root: Path, suite: str, versions: tuple[str, ...] = ("0.0.1", "0.0.2")) -> Path:
    """A throwaway kvcompat project: our noxfile and src, ``suite`` as tests/connectors, and a
    default matrix of fake vLLM wheels (one folder per version, all also in wheels/house)."""
    import shutil

    repo = Path(__file__).resolve().parents[2]
    (root / "tests" / "connectors").mkdir(parents=True)
    (root / "constraints").mkdir()
    shutil.copy(repo / "noxfile.py", root / "noxfile.py")
    (root / "src").symlink_to(repo / "src")
    (root / "tests" / "connectors" / "test_suite.py").write_text(suite)
    house = root / "wheels" / "house"
    house.mkdir(parents=True)
    wheels = []
    for v in versions:
        files = {**FAKE_CONNECTOR_FILES, "vllm/__init__.py": f"__version__ = {v!r}\n"}
        folder = root / "wheels" / v
        folder.mkdir(parents=True)
        wheels.append(build_wheel(folder, files, version=v))
        shutil.copy(wheels[-1], house / wheels[-1].name)
    entries = ", ".join(f'{{ vllm = "wheels/{w.parent.name}/{w.name}" }}' for w in wheels)
    (root / "pyproject.toml").write_text(f"[tool.kvcompat.matrix]\ndefault = [{entries}]\n")
    return root
