"""A vLLM git checkout as the commit bisect reads it: commits, refs and files, through ``git`` (nothing is checked out
in the user's work tree).  Bad input (not a git repository, an unknown ref, GOOD not an ancestor of BAD) is one
line naming the fix (:class:`kvcompat.bisection.BisectError`)."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvcompat import bisection as bis

GIT_URL = "https://github.com/vllm-project/vllm"


@dataclasses.dataclass(frozen=True)
class Commit:
    sha: str
    tree: str
    subject: str

    @property
    def short(self) -> str:
        return self.sha[:10]

    @property
    def label(self) -> str:
        subject = self.subject if len(self.subject) <= 50 else self.subject[:49] + "…"
        return f'{self.short} "{subject}"'


def git(repo: Path, *args: str) -> str:
    """``git -C repo ARGS``'s stdout; a failure raises :class:`subprocess.CalledProcessError` with stderr."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    except FileNotFoundError:
        raise bis.BisectError("git is not installed (bisecting commits runs git); install git") from None
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, proc.stdout, proc.stderr)
    return proc.stdout.decode(errors="replace")


def first_line(err: subprocess.CalledProcessError) -> str:
    text = (err.stderr or b"").decode(errors="replace").strip()
    return text.splitlines()[0] if text else f"exit status {err.returncode}"


def open_repo(path: Path) -> Path:
    """The top folder of the git repository at ``path``."""
    clone = f"point --repo at a vLLM git clone (git clone {GIT_URL})"
    if not path.is_dir():
        raise bis.BisectError(f"--repo {path} is not a folder; {clone}")
    try:
        return Path(git(path, "rev-parse", "--show-toplevel").strip())
    except subprocess.CalledProcessError as exc:
        raise bis.BisectError(f"--repo {path} is not a git repository ({first_line(exc)}); {clone}") from None


def resolve_ref(repo: Path, ref: str, role: str) -> str:
    """The full hash of the commit ``ref`` names (a hash, a tag, a branch, ``HEAD~3``)."""
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        raise bis.BisectError(
            f"{role} {ref!r} names no commit in {repo}; give a commit hash, tag or branch of it "
            f"(`git -C {repo} log --oneline --first-parent` lists them; a release tag may need `git fetch --tags`)"
        ) from None


def log_commits(repo: Path, *args: str) -> list[Commit]:
    out = git(repo, "log", "--format=%H%x00%T%x00%s%x00", *args)
    fields = out.split("\x00")
    return [
        Commit(fields[i].strip(), fields[i + 1], fields[i + 2])
        for i in range(0, len(fields) - 2, 3)
        if fields[i].strip()
    ]


def commits_between(repo: Path, good: str, bad: str, *, find_fix: bool = False) -> list[Commit]:
    """The older end, then every first-parent commit after it up to the newer end (oldest first).

    ``good`` is where the test passes and ``bad`` where it fails; with ``find_fix`` ``bad`` is the older.
    """
    (old_role, old_ref), (new_role, new_ref) = (
        (("BAD", bad), ("GOOD", good)) if find_fix else (("GOOD", good), ("BAD", bad))
    )
    old, new = resolve_ref(repo, old_ref, old_role), resolve_ref(repo, new_ref, new_role)
    if old == new:
        raise bis.BisectError(
            f"{old_role} {old_ref} and {new_role} {new_ref} are the same commit ({old[:10]}); "
            f"give an older {old_role} or a newer {new_role}"
        )

    def is_ancestor(a: str, b: str) -> bool:
        try:
            git(repo, "merge-base", "--is-ancestor", a, b)
            return True
        except subprocess.CalledProcessError:
            return False

    if not is_ancestor(old, new):
        if is_ancestor(new, old):
            hint = (
                "swap them (with --find-fix the fix comes after the break: BAD is the older)"
                if find_fix
                else "swap them, or add --find-fix to find the commit that fixed it"
            )
            raise bis.BisectError(
                f"{old_role} {old_ref} ({old[:10]}) is newer than {new_role} {new_ref} ({new[:10]}); {hint}"
            )
        raise bis.BisectError(
            f"{old_role} {old_ref} ({old[:10]}) is not an ancestor of {new_role} {new_ref} ({new[:10]}): they are "
            f"on different branches; give a {old_role} that {new_role}'s history holds "
            f"(`git -C {repo} merge-base {old[:10]} {new[:10]}` is where they part)"
        )
    first = log_commits(repo, "-1", old)
    after = log_commits(repo, "--first-parent", "--reverse", f"{old}..{new}")
    return first + after


def show_file(repo: Path, sha: str, path: str) -> bytes | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo), "show", f"{sha}:{path}"], capture_output=True, check=True)
    except subprocess.CalledProcessError:
        return None
    return proc.stdout


def git_blob_id(data: bytes, object_format: str) -> bytes:
    algo = hashlib.sha256 if object_format == "sha256" else hashlib.sha1
    return algo(b"blob %d\0" % len(data) + data).hexdigest().encode()


def release_of_tag(tag: str) -> Version | None:
    try:
        return Version(tag.strip().removeprefix("v"))
    except InvalidVersion:
        return None
