"""MultiConnector's methods across vLLM releases, read with ast from unpacked wheels.

The evidence behind section 2 of docs/vllm-multiconnector-history.md. Unpack the releases first with
``docs/evidence/release-source.sh VER...`` (into .kvcompat/release-src/VER/), then:

  python docs/evidence/multiconnector_methods.py defs              # def line of each method, per release
  python docs/evidence/multiconnector_methods.py bodies get_finished reset_cache
  python docs/evidence/multiconnector_methods.py gaps              # base methods MultiConnector does not override

Every release folder under --src that holds multi_connector.py is read; the others are named on stderr.
Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SRC = ROOT / ".kvcompat" / "release-src"
V1 = Path("vllm/distributed/kv_transfer/kv_connector/v1")
MULTI_FILE = V1 / "multi_connector.py"
BASE_FILE = V1 / "base.py"
MULTI_CLASS = "MultiConnector"
BASE_CLASS = "KVConnectorBase_V1"

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Release:
    """One unpacked release: its version and the folder that holds ``vllm/``."""

    version: str
    root: Path


def version_key(version: str) -> tuple[int, ...]:
    """Sort key: 0.9.2 before 0.11.2 (numeric parts only; rc/post suffixes sort by their number)."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


def find_releases(src: Path) -> list[Release]:
    """The release folders under ``src`` with a multi_connector.py, oldest first."""
    if not src.is_dir():
        sys.exit(f"error: no release sources at {src}: run docs/evidence/release-source.sh VER... first")
    found = []
    for child in sorted(src.iterdir(), key=lambda p: version_key(p.name)):
        if not child.is_dir() or child.name.endswith(".partial"):
            continue
        if (child / MULTI_FILE).is_file():
            found.append(Release(child.name, child))
        else:
            print(f"note: {child.name} has no {MULTI_FILE}; skipped", file=sys.stderr)
    if not found:
        sys.exit(f"error: no release under {src} has {MULTI_FILE}")
    return found


def read_class(path: Path, name: str) -> tuple[str, ast.ClassDef]:
    """The source text of ``path`` and its top-level class ``name``."""
    text = path.read_text(encoding="utf-8")
    for node in ast.parse(text, filename=str(path)).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return text, node
    sys.exit(f"error: no class {name} in {path}")


def methods(cls: ast.ClassDef) -> dict[str, Function]:
    """The functions defined directly in the class body, by name (the last definition wins, as in Python)."""
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def multi_methods(release: Release) -> tuple[str, dict[str, Function]]:
    """multi_connector.py's text and MultiConnector's methods in one release."""
    text, cls = read_class(release.root / MULTI_FILE, MULTI_CLASS)
    return text, methods(cls)


def cmd_defs(releases: list[Release]) -> None:
    """Markdown table: one row per method ever defined in MultiConnector, the def line per release."""
    per_release = {r.version: multi_methods(r)[1] for r in releases}
    names: list[str] = []
    for defined in per_release.values():
        names.extend(n for n in defined if n not in names)
    versions = [r.version for r in releases]
    print("| method | " + " | ".join(versions) + " |")
    print("|---|" + "---|" * len(versions))
    for name in names:
        cells = [str(per_release[v][name].lineno) if name in per_release[v] else "-" for v in versions]
        print(f"| {name} | " + " | ".join(cells) + " |")


def function_source(text: str, node: Function) -> str:
    """The function's source, decorators included, dedented."""
    lines = text.splitlines()
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))


def cmd_bodies(releases: list[Release], names: list[str]) -> None:
    """Each method's source in the first release that defines it and in every release where it changes."""
    sources = [multi_methods(r) for r in releases]
    for name in names:
        print(f"# {MULTI_CLASS}.{name}")
        previous: str | None = None
        for release, (text, defined) in zip(releases, sources, strict=True):
            node = defined.get(name)
            body = function_source(text, node) if node else None
            if body == previous:
                continue
            if node is None:
                print(f"\n## {release.version}: not defined\n")
            else:
                print(f"\n## {release.version} L{node.lineno}-{node.end_lineno}\n")
                print(body)
            previous = body
        if previous is None:
            print(f"\nnot defined in any release ({releases[0].version} .. {releases[-1].version})")
        print()


def cmd_gaps(releases: list[Release]) -> None:
    """Per release: the public methods of KVConnectorBase_V1 that MultiConnector does not define."""
    for release in releases:
        base_path = release.root / BASE_FILE
        if not base_path.is_file():
            print(f"- {release.version}: no {BASE_FILE}")
            continue
        _, base_cls = read_class(base_path, BASE_CLASS)
        overridden = multi_methods(release)[1]
        missing = [
            f"{name} (base L{node.lineno})"
            for name, node in methods(base_cls).items()
            if not name.startswith("_") and name not in overridden
        ]
        print(f"- {release.version}: " + (", ".join(missing) if missing else "none"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: a subcommand and --src."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--src",
        type=Path,
        default=DEFAULT_SRC,
        help="folder of unpacked releases, one VER/ each (default: .kvcompat/release-src)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("defs", help="markdown table of MultiConnector's def lines per release")
    bodies = sub.add_parser("bodies", help="each method's source, first release and every change")
    bodies.add_argument("methods", nargs="+", metavar="METHOD")
    sub.add_parser("gaps", help="public base-class methods MultiConnector does not override, per release")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand over every release found under --src."""
    args = parse_args(argv)
    releases = find_releases(args.src)
    if args.command == "defs":
        cmd_defs(releases)
    elif args.command == "bodies":
        cmd_bodies(releases, args.methods)
    else:
        cmd_gaps(releases)


if __name__ == "__main__":
    main()
