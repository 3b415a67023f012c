"""reports/compat.html in a real browser (Debian's headless Chromium): the grid renders, and a cell's
link opens its drill-down with the failing test's message, the installed versions and the log tail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcompat.outcomes import Outcome
from kvcompat.report.model import build_report
from kvcompat.report.write import write_reports
from kvcompat.results import write_result

from helpers import make_result

pytestmark = pytest.mark.slow  # drives headless Chromium

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]

if CHROMIUM is None:
    # CI installs chromium (.ci/run); only a developer machine without it may skip.
    if os.environ.get("CI"):
        raise RuntimeError("chromium is required in CI for the HTML report test; .ci/run installs it")
    pytest.skip("chromium not installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture
def report(tmp_path) -> Path:
    results = tmp_path / "results"

    def cell(vllm, torch, outcome, tests, **kw):
        return make_result(
            vllm,
            torch,
            outcome,
            tests,
            versions={"vllm": vllm, "torch": torch, "transformers": "5.20.2"},
            python="3.11.7",
            phases={"resolve": 2.1, "install": 30.0, "import": 18.0, "test": 40.0},
            log_tail="E   AssertionError: loaded by child 1",
            **kw,
        )

    write_result(
        results,
        cell(
            "0.33.0",
            "2.14.0",
            Outcome.PASS,
            [("test_load_nixl_first", "passed", None), ("test_store_all", "passed", None)],
            detail="2/2 tests passed",
        ),
    )
    write_result(
        results,
        cell(
            "0.26.0",
            "2.11.0",
            Outcome.TEST_FAIL,
            [
                ("test_load_nixl_first", "failed", "AssertionError: expected child 0 (Nixl), loaded by child 1"),
                ("test_store_all", "passed", None),
            ],
            detail="1/2 tests passed",
        ),
    )
    write_result(
        results,
        cell(
            "0.0.0.dev0", "pinned", Outcome.UNRESOLVABLE, [], detail="Because there is no version of vllm==0.0.0.dev0"
        ),
    )
    write_reports(build_report([results]), tmp_path / "reports")
    return tmp_path / "reports" / "compat.html"


def chromium(*args, tmp_path):
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_grid_renders_with_status_words(report, tmp_path):
    dom = chromium("--dump-dom", report.as_uri(), tmp_path=tmp_path).stdout
    assert dom.count('class="cell"') == 3
    assert ">pass 2/2</a>" in dom and ">test fail 1/2</a>" in dom and ">unresolvable</a>" in dom
    shot = tmp_path / "grid.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,700", report.as_uri(), tmp_path=tmp_path)
    assert shot.stat().st_size > 10_000


def test_clicking_a_cell_opens_its_drilldown(report, tmp_path):
    html = report.read_text()
    link = "#d-vllm-0_26_0__torch-2_11_0__ours"
    assert f'href="{link}"' in html  # what a click on the red cell navigates to
    shot = tmp_path / "drilldown.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,1400", report.as_uri() + link, tmp_path=tmp_path)
    assert shot.stat().st_size > 10_000
    # the panel is hidden until targeted: check the computed visibility in the browser itself
    probe = tmp_path / "probe.html"
    probe.write_text(
        html.replace(
            "</body>",
            """<script>
      window.addEventListener('load', () => {
      const p = document.getElementById('d-vllm-0_26_0__torch-2_11_0__ours');
      const q = document.getElementById('d-vllm-0_33_0__torch-2_14_0__ours');
      document.title = 'shown=' + getComputedStyle(p).display + ';other=' + getComputedStyle(q).display
        + ';msg=' + (p.innerText.includes('loaded by child 1')) + ';ver=' + p.innerText.includes('torch==2.11.0');
      document.body.setAttribute('data-probe', document.title);
      });
    </script></body>""",
        )
    )
    dom = chromium("--dump-dom", probe.as_uri() + link, tmp_path=tmp_path).stdout
    assert 'data-probe="shown=block;other=none;msg=true;ver=true"' in dom
    if os.environ.get("KVCOMPAT_SCREENSHOT_DIR"):  # keep the pictures for a human to look at
        out = Path(os.environ["KVCOMPAT_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / "drilldown.png")


def test_history_timeline_renders_and_its_squares_open_the_drilldown(tmp_path):
    """A history run's page leads with the timeline; a square is a link to its cell's panel."""
    results = tmp_path / "results"
    for vllm, torch, outcome, store in [
        ("0.18.1", "2.10.0", Outcome.PASS, "passed"),
        ("0.19.1", "2.10.0", Outcome.TEST_FAIL, "failed"),
        ("0.21.0", "2.11.0", Outcome.TEST_FAIL, "failed"),
        ("0.22.1", "2.11.0", Outcome.PASS, "passed"),
    ]:
        tests = [("test_store_all", store, "E  assert 0 == 2: stored once" if store == "failed" else None)]
        write_result(
            results, make_result(vllm, torch, outcome, tests, detail=f"{outcome.label}", versions={"vllm": vllm})
        )
    write_reports(build_report([results]), tmp_path / "reports")
    page = tmp_path / "reports" / "compat.html"
    link = "#d-vllm-0_19_1__torch-2_10_0__ours"
    probe = tmp_path / "probe.html"
    probe.write_text(
        page.read_text().replace(
            "</body>",
            """<script>
      window.addEventListener('load', () => {
      const t = document.querySelector('table.timeline');
      const sq = [...t.querySelectorAll('td.sq')].map(td => td.dataset.status).join(',');
      const a = t.querySelector('td.sq[data-status="test fail"] a');
      const p = document.getElementById(a.getAttribute('href').slice(1));
      const first = t.querySelector('h2') === null && document.querySelector('h2').textContent;
      document.body.setAttribute('data-probe', 'first=' + first + ';squares=' + sq + ';panel=' + getComputedStyle(p).display
        + ';fixed=' + t.innerText.includes('0.22.1') + ';width=' + (t.getBoundingClientRect().width > 300));
      });
    </script></body>""",
        )
    )
    dom = chromium("--dump-dom", probe.as_uri() + link, tmp_path=tmp_path).stdout
    assert 'data-probe="first=Timeline;squares=pass,test fail,test fail,pass;panel=block;fixed=true;width=true"' in dom
    shot = tmp_path / "timeline.png"
    chromium(f"--screenshot={shot}", "--window-size=1400,900", page.as_uri(), tmp_path=tmp_path)
    assert shot.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("panel", "says"),
    [
        (
            "d-vllm-0_34_0__torch-2_14_0__override-flashinfer-python-0_7_4__ours",
            "load error never reached the scheduler",
        ),
        ("d-vllm-0_33_0__torch-2_14_0__ours", "the CPU tier serves 0 tokens of A"),
    ],
)
def test_a_red_cells_drawer_shows_its_message_without_scrolling(tmp_path, monkeypatch, panel, says):
    """The default matrix with a new red beside the known bug, on a laptop-sized window: the red (and the
    known-bug) square's drawer opens with the failing test's message in view, the drawer not scrolled."""
    from test_report import LRU_BUG, NEW_RED, default_matrix

    from kvcompat import known_bugs

    bugs = tmp_path / "bugs.toml"
    bugs.write_text(LRU_BUG)
    monkeypatch.setenv(known_bugs.DATA_ENV, str(bugs))
    known_bugs.known.cache_clear()
    try:
        write_reports(build_report([default_matrix(tmp_path / "results", new_red=NEW_RED)]), tmp_path / "reports")
    finally:
        known_bugs.known.cache_clear()
    page = tmp_path / "reports" / "compat.html"
    html = page.read_text()
    assert f'href="#{panel}"' in html  # the grid's square links to the drawer
    probe = tmp_path / "probe.html"
    probe.write_text(
        html.replace(
            "</body>",
            """<script>
      window.addEventListener('load', () => {
        const p = document.querySelector('.panel:target');
        const m = p.querySelector('.red .headline');
        const pre = p.querySelector('.red pre');
        const box = p.getBoundingClientRect();
        const inView = (e) => { const b = e.getBoundingClientRect();
          return b.top >= box.top && b.top < box.bottom && b.bottom <= window.innerHeight; };
        document.body.setAttribute('data-probe', [
          'id=' + p.id, 'shown=' + getComputedStyle(p).display, 'scrolled=' + p.scrollTop,
          'message=' + inView(m), 'full=' + (pre === null || inView(pre)),
          'text=' + m.innerText.includes(SAYS)].join(';'));
      });
    </script></body>""".replace("SAYS", json.dumps(says)),
        )
    )
    dom = chromium("--dump-dom", "--window-size=1280,800", probe.as_uri() + f"#{panel}", tmp_path=tmp_path).stdout
    assert f'data-probe="id={panel};shown=block;scrolled=0;message=true;full=true;text=true"' in dom, dom[-2000:]
    if os.environ.get("KVCOMPAT_SCREENSHOT_DIR"):  # keep the picture for a human to look at
        shot = Path(os.environ["KVCOMPAT_SCREENSHOT_DIR"]) / f"drawer-{panel}.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        chromium(f"--screenshot={shot}", "--window-size=1280,800", page.as_uri() + f"#{panel}", tmp_path=tmp_path)
