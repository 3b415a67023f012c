"""The static ABI check on ELF files this test builds: a fake torch library and fake extensions."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvcompat import abi

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the ELF files")

# Mangled as a C++ compiler would name c10::impl::ok() and c10::impl::gone(); C lets us spell them directly.
TORCH_LIB = "void _ZN3c104impl2okEv(void) {}\nvoid aoti_torch_empty(void) {}\n"
EXTENSION = (
    "void _ZN3c104impl2okEv(void); void _ZN3c104impl4goneEv(void); void aoti_torch_empty(void);\n"
    "void _ZN2at6native3fooEv(void); void puts(void);\n"
    "void entry(void) { _ZN3c104impl2okEv(); _ZN3c104impl4goneEv(); aoti_torch_empty(); _ZN2at6native3fooEv(); puts(); }\n"
)


def shared_object(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.with_name(path.name.split(".")[0] + ".c")
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    return path


@pytest.fixture
def site(tmp_path):
    site = tmp_path / "site-packages"
    shared_object(site / "torch" / "lib" / "libtorch_cpu.so", TORCH_LIB)
    shared_object(site / "vllm" / "_C.abi3.so", EXTENSION)
    shared_object(
        site / "vllm" / "clean.abi3.so", "void _ZN3c104impl2okEv(void);\nvoid f(void) { _ZN3c104impl2okEv(); }\n"
    )
    (site / "vllm" / "not_elf.so").write_text("just text")
    return site


def test_missing_torch_symbols_are_found_and_nothing_else(site, tmp_path):
    verdict = abi.check(site, "9.9.9", tmp_path / "cache")
    assert verdict.extensions == 3
    assert verdict.missing == ["_ZN2at6native3fooEv", "_ZN3c104impl4goneEv"]  # not puts (libc), not the exported ones
    assert verdict.by_extension == {"vllm/_C.abi3.so": 2}
    data = verdict.to_json()
    assert data["missing"] == 2 and data["torch"] == "9.9.9"
    if shutil.which("c++filt"):
        assert data["examples"] == ["at::native::foo()", "c10::impl::gone()"]


def test_torch_exports_are_cached_per_version(site, tmp_path):
    cache = tmp_path / "cache"
    abi.check(site, "9.9.9", cache)
    assert (cache / "torch-9.9.9.json").is_file()
    shutil.rmtree(site / "torch")  # answered from the cache now
    assert abi.check(site, "9.9.9", cache).missing == ["_ZN2at6native3fooEv", "_ZN3c104impl4goneEv"]


def test_symbol_pattern():
    for name in (
        "_ZN3c104impl2okEv",
        "_ZNK3c1010TensorImpl4sizeEv",
        "_ZTVN2at6TensorE",
        "_ZN5torch3jit4loadEv",
        "aoti_torch_empty_strided",
        "torch_exception_get_what_without_backtrace",
    ):
        assert abi.TORCH_SYMBOL.search(name), name
    for name in ("puts", "_ZNSt6vectorIiE9push_backEv", "_ZN4vllm3fooEv", "PyInit__C"):
        assert not abi.TORCH_SYMBOL.search(name), name
