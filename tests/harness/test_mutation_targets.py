"""Mutation beyond multi_connector.py (kvcompat.mutation.targets, operators, covmap): the groups of files per
release, the mechanical operators and their ids, the scheduler and aggregator filters, coverage-based test
selection, the per-file guard and the per-file report.  Synthetic sources only: no vLLM, no venv."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from kvcompat.commands import mutants as front
from kvcompat.mutation import context, covmap, operators, plan, record, say, score
from kvcompat.mutation import targets as tg
from kvcompat.mutation.catalogue import TARGET
from kvcompat.mutation.guard import Guard, journaled, sha256_record
from kvcompat.report import mutants as report

EVERY = tg.Scope()


def target(path: str = "vllm/v1/thing.py", scope: tg.Scope = EVERY) -> tg.TargetFile:
    return tg.TargetFile(path, scope)


def mutants(source: str, scope: tg.Scope = EVERY, path: str = "vllm/v1/thing.py"):
    source = textwrap.dedent(source)
    made = operators.generate(source, target(path, scope))
    for m in made:
        m.apply(source)  # every mutant compiles
    return source, made


def changed(source: str, m) -> str:
    """The mutated line(s), stripped: what the mutant made of its site."""
    mutated = m.apply(source)
    lines = mutated.splitlines()
    return lines[m.line - 1].strip()


# -- operators --------------------------------------------------------------------------------------


def test_negate_if_covers_if_elif_and_while_but_not_an_if_that_only_logs():
    source, made = mutants(
        """
        def f(x, log):
            if x > 1:
                x = 0
            elif x:
                x = 2
            while x < 3:
                x += 1
            if x:
                logger.debug("x is %d", x)
            return x
        """
    )
    negated = [m for m in made if "-negate-if-" in m.id]
    assert [changed(source, m) for m in negated] == ["if not (x > 1):", "elif not (x):", "while not (x < 3):"]
    assert [m.id for m in negated] == ["gen-thing-f-negate-if-1", "gen-thing-f-negate-if-2", "gen-thing-f-negate-if-3"]


def test_compare_flips_each_operator_at_its_boundary():
    source, made = mutants(
        """
        def f(a, b, s):
            r = [a < b, a <= b, a > b, a >= b, a == b, a != b, a in s, a not in s, a is None, a is not None]
            return 0 <= a < b
        """
    )
    flips = [(m.replacement, m.description) for m in made if "-compare-" in m.id]
    assert [r for r, _ in flips] == ["<=", "<", ">=", ">", "!=", "==", "not in", "in", "is not", "is", "<", "<="]
    assert "`<` made `<=` in `a < b`" in flips[0][1]
    assert "return 0 <= a <= b" in [m for m in made if m.id == "gen-thing-f-compare-12"][0].apply(source)


def test_a_negated_equality_test_is_the_same_program_as_its_flipped_comparison():
    _, made = mutants(
        """
        def f(a):
            if a is None:
                return 1
            if a < 2:
                return 2
            return 3
        """
    )
    by_id = {m.id: m for m in made}
    assert by_id["gen-thing-f-compare-1"].same_as == "gen-thing-f-negate-if-1"  # not (a is None) == a is not None
    assert by_id["gen-thing-f-compare-2"].same_as is None  # not (a < 2) is a >= 2, not a <= 2


def test_and_or_swaps_every_operator_of_one_operation():
    source, made = mutants(
        """
        def f(a, b, c):
            x = a and b and (c or a)
            return x or None
        """
    )
    swaps = [m for m in made if "-and-or-" in m.id]
    assert [m.replacement for m in swaps] == ["a or b or (c or a)", "c and a", "x and None"]


def test_no_early_return_drop_call_and_del():
    source, made = mutants(
        """
        def f(self, req):
            if req in self.done:
                return None
            self.pending.add(req)
            self.ready.append(req)
            self.compute(req)
            del self.map[req]
            return req
        """
    )
    ops = {m.id.split("-f-")[1]: changed(source, m) for m in made if "negate-if" not in m.id and "compare" not in m.id}
    assert ops == {
        "no-early-return-1": "pass",
        "drop-call-1": "pass",
        "drop-call-2": "pass",
        "drop-call-3": "pass",
    }  # self.compute(req) is not a state change by name; the last return is not early
    assert "`self.pending.add(req)` dropped" in [m for m in made if m.id.endswith("drop-call-1")][0].description


def test_const_bumps_int_literals_in_arithmetic_and_comparisons_only():
    source, made = mutants(
        """
        def f(n, xs):
            m = n - 1
            m += 2
            if n > 0:
                m = xs[3]
            return foo(4, -5 * n)
        """
    )
    consts = [(m.replacement, changed(source, m)) for m in made if "-const-" in m.id]
    assert consts == [("2", "m = n - 2"), ("3", "m += 3"), ("1", "if n > 1:"), ("6", "return foo(4, -6 * n)")]


def test_zero_return_where_a_function_returns_a_number():
    _, made = mutants(
        """
        def count(xs) -> int:
            return len(xs)

        def total(xs):
            return sum(xs) + 1

        def name(x):
            return str(x)

        def zero() -> int:
            return 0

        def maybe(x) -> int | None:
            if x:
                return None
            return x
        """
    )
    zero = {m.contract: m.replacement for m in made if "-zero-return-" in m.id}
    assert zero == {"count": "0", "total": "0", "maybe": "0"}  # maybe's `return x`, not its None


def test_asserts_raises_logging_and_fstrings_are_left_alone():
    _, made = mutants(
        """
        def f(x):
            assert x is not None and x > 0
            logger.info("x %d", x + 1)
            y = f"{x == 1}"
            if x == 2:
                raise ValueError(x == 3)
            return y
        """
    )
    assert [m.id for m in made] == ["gen-thing-f-negate-if-1", "gen-thing-f-compare-1", "gen-thing-f-const-1"]


def test_ids_name_file_class_and_method_and_stay_put_when_other_code_changes():
    before = """
        class Worker:
            def a(self, x):
                if x:
                    return 1
                return 2

            def b(self, x):
                return x == 1
        """
    after = """
        import os

        def helper():
            return os.getpid() > 1

        class Worker:
            def z(self):
                if True:
                    pass

            def a(self, x):
                if x:
                    return 1
                return 2

            def b(self, x):
                y = x != 0
                return x == 1
        """
    _, old = mutants(before, path=tg.NIXL_PACKAGE + "base_worker.py")
    _, new = mutants(after, path=tg.NIXL_PACKAGE + "base_worker.py")
    old_ids, new_ids = [m.id for m in old], {m.id for m in new}
    assert old_ids[0] == "gen-nixl-base-worker-worker-a-negate-if-1"
    assert "gen-nixl-base-worker-helper-compare-1" in new_ids  # a module-level function: no class
    assert set(old_ids) - {"gen-nixl-base-worker-worker-b-compare-1"} <= new_ids  # a's unchanged
    # b gained a comparison before the old one: its ranks move, a's do not
    assert {m.id: m.description for m in new}["gen-nixl-base-worker-worker-b-compare-2"].endswith("in `x == 1`")


def test_a_property_getter_and_setter_share_their_numbering():
    _, made = mutants(
        """
        class C:
            @property
            def size(self):
                return self._n > 0

            @size.setter
            def size(self, n):
                self._n = n - 1
        """
    )
    assert [m.id for m in made] == [
        "gen-thing-c-size-compare-1",
        "gen-thing-c-size-const-1",
        "gen-thing-c-size-const-2",
    ]
    assert made[-1].replacement == "2"  # the setter's n - 1, numbered after the getter's sites


def test_file_slugs():
    assert tg.file_slug(tg.NIXL_PACKAGE + "pull_scheduler.py") == "nixl-pull-scheduler"
    assert tg.file_slug(tg.NIXL_SINGLE_FILE) == "nixl-connector"
    assert tg.file_slug(tg.SCHEDULER_FILE) == "scheduler"
    assert tg.file_slug(tg.AGGREGATOR_FILE) == "kv-connector-utils"
    assert tg.file_slug("vllm/v1/simple_kv_offload/manager.py") == "simple-kv-offload-manager"
    assert tg.file_slug(tg.OFFLOAD_FILES[0]) == "simple-cpu-offload-connector"


# -- scopes -----------------------------------------------------------------------------------------

SCHEDULER = """
class Scheduler:
    def __init__(self, cfg):
        self.connector = make(cfg)

    def schedule(self):
        if self.connector is not None:
            self.connector.build_meta()
        return 1

    def _free_blocks(self, req):
        self.kv_cache_manager.free(req)

    def _update_from_kv_xfer_finished(self, out):
        for r in out.finished_recving or ():
            self.done.add(r)

    def get_grammar_bitmask(self):
        return self.grammar > 0

    def _free_encoder_inputs(self, req):
        if self.ec_connector is not None:
            self.ec_connector.free(req)

    def has_finished_requests(self):
        return len(self.finished_req_ids) > 0 or self.WAITING_FOR_REMOTE_KVS


def module_function(connector):
    return connector > 1
"""


def test_the_scheduler_filter_takes_the_methods_on_the_connectors_path():
    scope = tg.Scope(classes=("Scheduler",), functions=False, connector_paths=True)
    chosen = [fn.contract for fn in operators.functions(SCHEDULER, scope)]
    assert chosen == [
        "Scheduler.__init__",
        "Scheduler.schedule",
        "Scheduler._free_blocks",  # by its own name
        "Scheduler._update_from_kv_xfer_finished",
        "Scheduler.has_finished_requests",
    ]  # not the grammar, not the encoder-cache connector, not a module function


MIXED = """
class Scheduler:
    def schedule(self):
        budget = self.max_tokens - 1
        if self.connector is not None:
            ext = self.connector.get_num_new_matched_tokens(budget + 1)
        else:
            ext = budget - 7
        self.ec_connector.build_connector_meta(budget > 2)
        for req in self.waiting:
            if req.status == WAITING_FOR_REMOTE_KVS:
                req.tokens = ext + 3
            req.steps = req.steps + 4
        return budget > 5

    def _update_from_kv_xfer_finished(self, out):
        return len(out) > 6
"""


def test_the_scheduler_group_mutates_only_the_statements_on_the_connectors_path():
    target = tg.TargetFile(
        "vllm/v1/core/sched/scheduler.py", tg.Scope(("Scheduler",), functions=False, connector_paths=True)
    )
    made = operators.generate(MIXED, target)
    lines = {m.line for m in made}
    assert lines == {5, 6, 8, 11, 12, 17}  # the connector's `if` with its else, the WAITING_FOR_REMOTE_KVS branch,
    # and every line of a method named after a KV transfer; not the budget, the encoder-cache connector, the loop's
    # general bookkeeping or the return


def test_the_aggregator_filter_takes_one_class():
    source = """
def clip(blocks):
    return blocks[:1]

class KVOutputAggregator:
    def aggregate(self, outs):
        return [o for o in outs if o is not None]

    class Inner:
        def x(self):
            return 1 > 0

class TransferTopology:
    def tp_ratio(self, n):
        return n // 2
"""
    scope = tg.Scope(classes=("KVOutputAggregator",), functions=False)
    assert [fn.contract for fn in operators.functions(source, scope)] == [
        "KVOutputAggregator.aggregate",
        "KVOutputAggregator.Inner.x",
    ]
    made = operators.generate(source, tg.TargetFile(tg.AGGREGATOR_FILE, scope))
    assert {m.contract for m in made} == {"KVOutputAggregator.aggregate", "KVOutputAggregator.Inner.x"}


def fake_site(tmp_path: Path, files: dict[str, str]) -> Path:
    site = tmp_path / "site"
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    info = site / "vllm-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "RECORD").write_text(
        "".join(f"{rel},sha256={sha256_record(text.encode())},{len(text)}\n" for rel, text in files.items())
    )
    return site


def test_groups_are_resolved_by_probing_the_installed_files(tmp_path):
    nixl = {
        tg.NIXL_PACKAGE + f: "def f():\n    return 1\n" for f in ("connector.py", "pull_worker.py", "push_worker.py")
    }
    offload = {p: "x = 1\n" for p in (*tg.OFFLOAD_FILES, *tg.OFFLOAD_REPLACED)}
    site = fake_site(tmp_path / "new", {TARGET: "x = 1\n", **nixl, **offload})
    r = tg.resolve(site, "nixl")
    assert [f.path.rsplit("/", 1)[1] for f in r.files] == ["connector.py", "pull_worker.py"]  # never push_*
    assert r.files[0].scope.exclude_classes.search("NixlPushConnector")
    r = tg.resolve(site, "offload")
    assert [f.path for f in r.files] == list(tg.OFFLOAD_FILES) and r.replaced == tg.OFFLOAD_REPLACED
    assert tg.resolve(site, "multi").files[0].path == TARGET
    assert tg.resolve(site, "scheduler").absent and not tg.resolve(site, "aggregator").files

    old = fake_site(tmp_path / "old", {tg.NIXL_SINGLE_FILE: "x = 1\n"})
    assert [f.path for f in tg.resolve(old, "nixl").files] == [tg.NIXL_SINGLE_FILE]
    assert tg.resolve(old, "offload").absent == "no SimpleCPUOffloadConnector in this release"
    with pytest.raises(tg.TargetError, match="--target gpu: no such group; pick from multi, nixl"):
        tg.check_groups(("gpu",))


def test_connector_py_leaves_the_push_connector_out():
    source = """
class NixlPullConnector:
    def start_load_kv(self, x):
        if x:
            self.w.start(x)

class NixlPushConnector:
    def start_load_kv(self, x):
        if x:
            self.w.push(x)
"""
    scope = tg.Scope(exclude_classes=tg.NIXL_EXCLUDED_CLASSES)
    assert {m.contract for m in operators.generate(source, tg.TargetFile(tg.NIXL_PACKAGE + "connector.py", scope))} == {
        "NixlPullConnector.start_load_kv"
    }


# -- coverage-based selection ------------------------------------------------------------------------

MODULE = """\
FLAG = 0


class C:
    def f(self, x):
        if x > 0:
            return x
        return 0

    def g(self):
        return 2

    def h(self):
        return 3
"""


def site_at(source: str, needle: str) -> tuple[int, int]:
    start = source.index(needle)
    return start, start + len(needle)


def test_where_a_mutant_is():
    loc = covmap.Locator(MODULE)
    at = loc.where(*site_at(MODULE, "x > 0"))
    assert at.lines == {6} and at.in_function
    at = loc.where(*site_at(MODULE, "return x\n"))
    assert at.lines == {7} and at.in_function  # the blanks around a span do not count
    start, end = site_at(MODULE, ":\n        if x > 0:")
    at = loc.where(start + 1, end)
    assert at.lines == {6} and at.in_function  # a catalogue target that starts with the newline before its code
    at = loc.where(*site_at(MODULE, "FLAG = 0"))
    assert not at.in_function
    at = loc.where(*site_at(MODULE, "def g(self):"))
    assert not at.in_function  # a signature runs at import
    spanning = site_at(MODULE, "if x > 0:\n            return x\n        return 0")
    at = loc.where(*spanning)
    assert at.in_function and 6 in at.lines


def test_select_runs_the_tests_that_reach_the_lines_in_baseline_order():
    fake = {6: frozenset({"t::b", "t::a"}), 7: frozenset({"t::a"}), 11: frozenset({""}), 14: frozenset({"t::red"})}
    passed = ["t::a", "t::b", "t::c"]
    loc = covmap.Locator(MODULE)

    def pick(needle):
        return covmap.select(fake, loc.where(*site_at(MODULE, needle)), passed)

    assert pick("x > 0").tests == ("t::a", "t::b")
    assert pick("return x").tests == ("t::a",)  # line 7 only: t::b ran the test, never the return
    assert pick("return 2").tests is None  # a line run outside any test (import, a thread): the whole suite
    unreached = pick("return 3")  # only a test red on the baseline ran it
    assert unreached.tests == () and not unreached.reached and unreached.why == covmap.NOT_REACHED
    assert pick("FLAG = 0").tests is None  # module level: the whole suite
    assert covmap.select(None, loc.where(*site_at(MODULE, "x > 0")), passed).tests is None  # no map
    assert covmap.select({}, loc.where(*site_at(MODULE, "x > 0")), passed).tests == ()  # a file never run


def test_the_map_is_reused_while_the_suite_and_the_files_are_unchanged(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_a.py").write_text("def test_a():\n    pass\n")
    fp = covmap.fingerprint([suite], ["-m", "not gpu"], {"ORDER": "nixl-first"})
    files = {"vllm/a.py": {3: frozenset({"t::a", ""})}, "vllm/b.py": {}}
    hashes = {"vllm/a.py": "h1", "vllm/b.py": "h2"}
    path = covmap.map_path(tmp_path, "cell", "nixl")
    covmap.save(path, "cell", "nixl", "ours", fp, hashes, files)
    covmap.save(path, "cell", "nixl", "upstream", "other", hashes, {"vllm/a.py": {}, "vllm/b.py": {}})
    assert covmap.load(path, "ours", fp, hashes) == files
    assert covmap.load(path, "upstream", "other", hashes) == {"vllm/a.py": {}, "vllm/b.py": {}}
    assert covmap.load(path, "ours", fp, {**hashes, "vllm/b.py": "new"}) is None  # a file changed
    (suite / "test_a.py").write_text("def test_a():\n    assert 1\n")
    assert covmap.fingerprint([suite], ["-m", "not gpu"], {"ORDER": "nixl-first"}) != fp  # the suite changed
    assert covmap.fingerprint([suite], ["-m", "gpu"], {"ORDER": "nixl-first"}) != fp
    assert path.name == "mutants-cell.coverage-nixl.json"


def test_a_map_measured_with_some_shapes_is_not_the_map_of_a_run_with_every_shape():
    """KVCOMPAT_SHAPES reaches the suite from the process's environment, not the run's env: the map's fingerprint
    takes it in, so a map measured with shapes left out (their tests' lines unmeasured) never serves a run with
    every shape, which would run each mutant only against the tests of the shapes measured."""
    from kvcompat.mutation.baseline import selection_env

    env = {"ORDER": "nixl-first"}
    assert selection_env(env, {}) == env  # unset: the fingerprint of every map stored before stays the same
    assert selection_env(env, {"KVCOMPAT_SHAPES": ""}) == env
    assert selection_env(env, {"KVCOMPAT_SHAPES": "dense hybrid"}) == {**env, "KVCOMPAT_SHAPES": "dense hybrid"}


def test_the_plugins_output_is_read_and_an_empty_measurement_is_not_used(tmp_path):
    out = tmp_path / "cov.json"
    out.write_text(json.dumps({"tests": ["", "t::a"], "files": {"vllm/a.py": {"3": [0, 1], "4": [1]}}}))
    files = covmap.read_plugin_output(out)
    assert files == {"vllm/a.py": {3: frozenset({"", "t::a"}), 4: frozenset({"t::a"})}}
    assert covmap.usable(files)
    assert not covmap.usable({"vllm/a.py": {}}) and not covmap.usable(None)
    assert covmap.read_plugin_output(tmp_path / "missing.json") is None


def test_only_runs_the_listed_tests_and_never_none(pytester):
    pytester.makepyfile(test_x="def test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n")
    only = pytester.path / "only.txt"
    only.write_text("test_x.py::test_b\ntest_x.py::test_c\n")
    result = pytester.runpytest_subprocess("-p", "kvcompat.mutation.incell.covplugin", f"--kvcompat-only={only}")
    result.assert_outcomes(passed=2, deselected=1)
    only.write_text("test_x.py::test_gone\n")  # a stale list: the whole suite, not an empty run
    pytester.runpytest_subprocess(
        "-p", "kvcompat.mutation.incell.covplugin", f"--kvcompat-only={only}"
    ).assert_outcomes(passed=3)


def test_the_plugin_maps_lines_to_tests(pytester, monkeypatch):
    pytest.importorskip("coverage")
    pkg = pytester.mkpydir("pkg")
    (pkg / "mod.py").write_text("X = 1\n\ndef f(a):\n    if a:\n        return 1\n    return 0\n")
    pytester.makepyfile(
        test_m="from pkg import mod\n\ndef test_one():\n    assert mod.f(1)\n\ndef test_zero():\n    assert not mod.f(0)\n"
    )
    out = pytester.path / "map.json"
    monkeypatch.setenv(covmap.ENV_OUT, str(out))
    monkeypatch.setenv(covmap.ENV_FILES, "pkg/mod.py")
    pytester.runpytest_subprocess("-p", "kvcompat.mutation.incell.covplugin").assert_outcomes(passed=2)
    files = covmap.read_plugin_output(out)["pkg/mod.py"]
    assert files[1] == {""} and files[5] == {"test_m.py::test_one"} and files[6] == {"test_m.py::test_zero"}


# -- the guard, per file --------------------------------------------------------------------------------


def test_each_file_has_its_own_pristine_copy_and_journal(tmp_path):
    other = tg.NIXL_PACKAGE + "pull_worker.py"
    site = fake_site(tmp_path, {TARGET: "A = 1\n", other: "B = 1\n"})
    state = tmp_path / "state"
    multi, nixl = Guard(site, state, TARGET), Guard(site, state, other)
    assert (multi.journal.name, multi.pristine.name) == ("journal.json", "pristine.py")  # as before groups
    assert nixl.journal.name == "journal--vllm--distributed--kv_transfer--kv_connector--v1--nixl--pull_worker.py.json"
    nixl.save_pristine()
    nixl.apply("gen-x", "B = 2\n")
    assert journaled(state) == [other] and (site / TARGET).read_text() == "A = 1\n"
    # a later session puts it back from the journal, whichever group it runs
    assert "restored " + other in Guard(site, state, other).recover()
    assert nixl.is_pristine() and journaled(state) == []


# -- the session's pieces ------------------------------------------------------------------------------


def test_results_and_options_per_group(tmp_path):
    assert record.results_path(tmp_path, "c").name == "mutants-c.json"  # multi: as before groups
    assert record.results_path(tmp_path, "c", "offload").name == "mutants-c--offload.json"

    class Values:
        mutant = ()
        mutant_timeout = None
        index_url = "https://pypi.org/simple"
        find_links = ()
        upstream_only = False
        target = ("offload", "aggregator", "offload")

    assert front.options_for(tmp_path, Values()).targets == ("offload", "aggregator")
    Values.target = ()
    assert front.options_for(tmp_path, Values()).targets == ("multi",)


def test_an_unreached_survivor_is_reported_without_a_run():
    where = covmap.Where(frozenset({7, 8}), True)
    m = operators.generate("def f():\n    return 1\n", target())
    p = plan.Planned(m[0] if m else None, "", "vllm/v1/thing.py", 7, where)
    fake = type("M", (), {"id": "gen-x", "contract": "C.f", "description": "d", "equivalent": None})()
    p.mutant = fake
    v = score.unreached(p, covmap.Selection((), covmap.NOT_REACHED))
    assert (v.status, v.how, v.reason, v.tests_run, v.seconds) == ("survived", "unreached", "no test reaches it", 0, 0)
    assert v.detail == "no test green on the baseline executes lines 7-8 of thing.py"
    assert say.ours_line(v) == "SURVIVED (C.f): no test reaches it (not run)"


# -- the report ----------------------------------------------------------------------------------------


def run_json(group: str, mutants: list[dict], **extra) -> dict:
    return {
        "schema": report.SCHEMA,
        "id": "vllm-9.9.9",
        "group": group,
        "started": "t",
        "finished": "t2",
        "scored": True,
        "files": [{"path": "vllm/a.py", "functions": ["Scheduler.schedule"]}, {"path": "vllm/b.py", "functions": []}],
        "timing": {"baseline_s": 30.0, "mutants_s": 90.0, "decided": len(mutants), "runs": 3},
        "selection": "coverage: measured on this session's baseline",
        "mutants": mutants,
        **extra,
    }


def m(i: str, status: str, file: str = "vllm/a.py", how: str | None = None, line: int = 3, **extra) -> dict:
    return {
        **extra,
        "id": i,
        "contract": "C.f",
        "description": f"desc {i}",
        "status": status,
        "how": how,
        "file": file,
        "line": line,
    }


def test_the_report_counts_and_lists_survivors_per_file(tmp_path):
    runs = [
        run_json(
            "scheduler",
            [
                m("k", "killed"),
                m("s", "survived", line=12),
                m("u", "survived", how="unreached", line=40),
                m("x", "survived", line=13, explained="only TP > 1 reaches it (a.py:13)"),
                m("e", "equivalent", file="vllm/b.py"),
                m("n", "not_applicable", file="vllm/b.py"),
            ],
            replaced=["vllm/v1/simple_kv_offload/copy_backend.py"],
        ),
        run_json("multi", [m("k2", "killed", file=TARGET)], files=[]),
    ]
    for r in runs:
        name = "mutants-vllm-9.9.9.json" if r["group"] == "multi" else f"mutants-vllm-9.9.9--{r['group']}.json"
        (tmp_path / name).write_text(json.dumps(r))
    loaded = report.load([tmp_path])
    assert [r["group"] for r in loaded] == ["multi", "scheduler"]  # one cell, two groups: both kept
    assert report.file_counts(loaded[1]) == {
        "vllm/a.py": {
            "killed": 1,
            "survived": 2,
            "not reached": 1,
            "explained": 1,
            "equivalent": 0,
            "not applicable": 0,
        },
        "vllm/b.py": {
            "killed": 0,
            "survived": 0,
            "not reached": 0,
            "explained": 0,
            "equivalent": 1,
            "not applicable": 1,
        },
    }
    md = report.render_markdown(loaded)
    assert "| vllm-9.9.9 (scheduler) | 1 | 3 |" in md
    assert "| vllm-9.9.9 | scheduler | `a.py` | 1 | 2 | 1 | 1 | 0 | 0 |" in md
    assert "- `s` (line 12): desc s" in md and "Not reached by any test:" in md and "- `u` (line 40): desc u" in md
    assert "Explained (1, lines 13): only TP > 1 reaches it (a.py:13)\n\n- `x` (line 13): desc x" in md
    assert "120 s in all (baseline 30 s, mutants 90 s): 6 mutants, 15.0 s a mutant; 3 suite runs" in md
    assert "methods chosen (1): `Scheduler.schedule`" in md
    assert "transport replaced (not mutated): `v1/simple_kv_offload/copy_backend.py`" in md
    html = report.render_html(loaded)
    assert "<h3>Per file</h3>" in html and "vllm-9.9.9 (scheduler)" in html
    assert re.search(r"<td>vllm-9.9.9</td><td>multi</td><td><code>v1/multi_connector.py</code></td><td>1</td>", html)


def test_the_report_says_how_long_each_suite_took_a_mutant():
    """With the upstream column scored too, the timing line gives each suite's seconds a mutant apart."""
    from kvcompat.report import mutants as report

    run = {"timing": {"baseline_s": 30, "mutants_s": 90, "decided": 5, "runs": 3, "ours_s": 10, "upstream_s": 80}}
    assert report.timing(run) == (
        "120 s in all (baseline 30 s, mutants 90 s): 5 mutants, 18.0 s a mutant "
        "(our suite 2.0 s a mutant, vLLM's own 16.0 s); 3 suite runs, 30.0 s a suite run"
    )


def test_a_rerun_of_a_few_mutants_writes_the_kept_verdicts_from_its_first_write(tmp_path):
    """--mutant ID: the previous run's other verdicts are in the run from the start, so the results file
    written before the first new verdict (after the baseline) still holds the whole score."""
    import dataclasses as _dc
    import types as _types

    out = tmp_path / "mutants-c--nixl.json"
    prev = record.MutationRun(cell={"id": "c"}, catalogue="", target="nixl", started="t", scored=True, group="nixl")
    prev.mutants = [record.MutantVerdict(id=i, contract="C.f", description="d", status="killed") for i in ("a", "b")]
    out.write_text(json.dumps(prev.to_json()))
    run = _dc.replace(prev, mutants=[], scored=False)
    g = _types.SimpleNamespace(
        run=run, out=out, planned=[_types.SimpleNamespace(mutant=_types.SimpleNamespace(id="a"))], explain=lambda v: v
    )
    mo = _types.SimpleNamespace(only=("a",), upstream_only=False)
    plan.keep_previous(g, cell=None, mo=mo)
    assert [m.id for m in run.mutants] == ["a", "b"]


def test_survivors_are_explained_afresh_on_every_run_kept_verdicts_too(tmp_path):
    """A survivor gets its [[explained]] reason from today's file: an entry added since (or one taken away)
    shows on a rerun of a few mutants; a killed mutant never carries one."""
    from kvcompat.mutation import generate as gen

    path = tmp_path / "equivalent-nixl.toml"
    path.write_text(
        '[[explained]]\nids = ["gen-a-.*"]\nregex = true\nreleases = ["0.34.0"]\nreason = "TP > 1 (a.py:3)"\n'
    )
    run = record.MutationRun(cell={"id": "c"}, catalogue="", target="t", started="t", group="nixl")
    g = plan.Group("nixl", None, {}, [], run, tmp_path / "out.json", reasons=gen.load_reasons(path), release="0.34.0")
    v = lambda i, st, e=None: record.MutantVerdict(id=i, contract="C.f", description="d", status=st, explained=e)  # noqa: E731
    assert g.explain(v("gen-a-1", "survived")).explained == "TP > 1 (a.py:3)"
    assert g.explain(v("gen-a-2", "killed", "stale")).explained is None
    assert g.explain(v("gen-b-1", "survived", "stale")).explained is None, "a reason taken away goes away"
    run.mutants = [g.explain(v("gen-a-1", "survived")), v("gen-b-1", "survived")]
    assert run.explained == 1 and run.to_json()["explained"] == 1
    run.scored = True
    assert "(1 explained)" in say.summary(run)


def test_an_interrupted_run_resumes_and_a_finished_one_is_scored_afresh(tmp_path):
    """A full run stopped part-way leaves its verdicts in the results file; the next run of the same group,
    suite and arguments keeps them and scores only the rest.  A finished run, or one of another suite, is
    scored afresh."""
    import types as _types

    out = tmp_path / "mutants-c--nixl.json"
    prev = record.MutationRun(cell={"id": "c"}, catalogue="", target="nixl", started="t", scored=True, group="nixl")
    prev.suite = "fp1"
    prev.mutants = [record.MutantVerdict(id="a", contract="C.f", description="d", status="killed")]
    out.write_text(json.dumps(prev.to_json()))

    def keep(suite: str):
        run = record.MutationRun(cell={"id": "c"}, catalogue="", target="nixl", started="t2", group="nixl", suite=suite)
        planned = [_types.SimpleNamespace(mutant=_types.SimpleNamespace(id=i)) for i in ("a", "b")]
        g = _types.SimpleNamespace(run=run, out=out, planned=planned, explain=lambda v: v)
        plan.keep_previous(g, cell=None, mo=_types.SimpleNamespace(only=(), upstream_only=False))
        return [v.id for v in g.kept], [p.mutant.id for p in g.planned]

    assert keep("fp1") == (["a"], ["b"]), "resumed after the verdicts it had"
    assert keep("fp2") == ([], ["a", "b"]), "another suite: scored afresh"
    prev.finished = "t1"
    out.write_text(json.dumps(prev.to_json()))
    assert keep("fp1") == ([], ["a", "b"]), "a finished run is not resumed: a new run scores afresh"


def test_ours_only_leaves_the_upstream_column_out(monkeypatch):
    """--ours-only: the session scores the cell without its upstream column (added later with
    --upstream-only); the two together are a one-line error."""
    import dataclasses as _dc
    import types as _types

    from kvcompat.mutation import session as s

    @_dc.dataclass(frozen=True)
    class Cell:  # the one field run_targets reads
        suites: tuple[str, ...]

    seen = []
    monkeypatch.setattr(s, "_run", lambda cell, mo, progress: seen.append(cell.suites) or [])
    cell = Cell(("ours", "upstream"))
    s.run_targets(cell, _types.SimpleNamespace(ours_only=True, upstream_only=False))
    s.run_targets(cell, _types.SimpleNamespace(ours_only=False, upstream_only=False))
    assert seen == [("ours",), ("ours", "upstream")]
    with pytest.raises(context.MutationError, match="exclude each other"):
        s.run_targets(cell, _types.SimpleNamespace(ours_only=True, upstream_only=True))
