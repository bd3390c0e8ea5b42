"""The tree describes the system as it is: no lab diary in code, comments, docs or
notebooks. Measurements that justify a default live in docs/benchmarks.md with their
date and commit; what changed when lives in git's history and CHANGELOG.md.

The check scans every .py, .md, .ipynb and .sh file git tracks or would track (every
such file under the repository root where git is absent) for labels of past work
(PATTERNS; test_the_check_finds_history_and_passes_present_tense shows examples):

  * a numbered work session, also as part of a name;
  * a numbered run used as a label; a count of things after "runs" (warps,
    iterations, ...) is not one;
  * a numbered issue: vLLM's pull requests are cited by their number without the
    word (docs/semantics.md, appendix A);
  * files named by a session, and citations of the lab logs that the docs folder
    once held, which are not in the tree;
  * notes about what was tried and then left out;
  * section references into the external spec or its architecture notes: the tree cites
    its own docs/semantics.md (same numbering) and docs/design.md.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".md", ".ipynb", ".sh")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", "build", "dist",
             ".venv", "venv", "node_modules"}

# a number after "runs?" followed by one of these is a count, not a label
_COUNT_WORDS = (r"warps?|programs?|threads?|tokens?|times|calls?|steps?|kernels?|layers?|requests?|"
                r"iterations?|rows?|columns?|cols|bytes?|blocks?|pages?|pools?|devices?|GPUs?|seeds?|"
                r"ms|us|s|of")
PATTERNS = {
    "work session": re.compile(r"\bsessions?[ \t_-]*\d", re.I),
    "run label": re.compile(r"\bruns?[ \t]+\d+(?:[ \t]*-[ \t]*\d+)?\b(?![ \t]+(?:" + _COUNT_WORDS + r")\b)", re.I),
    "issue number": re.compile(r"\bissues?[ \t]*#?[ \t]*\d", re.I),
    "session-named file": re.compile(r"(?:\bgpu_s\d+|_s\d+(?:_run\d+)?)(?:[._]\w*)?\.(?:py|sh|txt|log|json|patch|csv)\b",
                                     re.I),
    "lab log": re.compile(r"\bdocs/results/"),
    "tried, not kept": re.compile(r"\btried and (?:not kept|dropped|reverted|abandoned)\b", re.I),
    "external spec": re.compile(r"\bspec(?:'s)?[ \t]+(?:sections?[ \t]+|§[ \t]*|bug[ \t]+)?(?:\d|[A-C]\d|app)|"
                                r"\bARCHITECTURE\.md\b|§[ \t]*\d", re.I),
}


def tracked_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files with SUFFIXES that git tracks or would track (ignored ones left out), or
    every such file under root (hidden and build folders left out) where git or the
    repository is absent."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *(f"*{s}" for s in SUFFIXES)], cwd=root, capture_output=True, check=True,
                             timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
        return [root / n for n in names if (root / n).is_file()]
    except (OSError, subprocess.SubprocessError):
        found = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".")]
            found += [pathlib.Path(d) / f for f in files if f.endswith(SUFFIXES)]
        return sorted(found)


def history_hits(text: str) -> list[tuple[int, str, str]]:
    """[(line number, pattern name, matched text)] of every history label in text."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for name, pat in PATTERNS.items():
            for m in pat.finditer(line):
                hits.append((i, name, m.group(0)))
    return hits


def test_the_check_finds_history_and_passes_present_tense():
    """The patterns are sharp both ways: each kind of label is found, and ordinary
    present-tense text with numbers next to the same words is not. (Built from pieces,
    so this file passes its own scan.)"""
    s, r, i = "sess" + "ion", "ru" + "n", "iss" + "ue"
    bad = [f"measured in {s} 12", f"{s}s 8-12's forms", f"the {s}-13 hadamard", f"def {s}12_exp_f32(d):",
           f"H200, {s} 17 ({r} 5)", f"(device spans, {r}s 2-3)", f"{r.capitalize()} 1 replayed the step",
           f"the {i}'s goals, {i} 3", f"see {i} #12", "tests/scripts/gpu_diag_s" + "5.py",
           "bash benchmarks/gpu_s" + "21.sh", "docs/" + "results/2026-12-01_x.patch", "a 2026-12-01_s" + "17_exp.patch",
           "Tried and " + "not kept: a 256-entry table", "the decode update (sp" + "ec 5.4)",
           "sp" + "ec B1 through the seed", "(sp" + "ec Appendix C)", "ARCHITEC" + "TURE.md", "(\u00a7" + "6.1)"]
    for text in bad:
        assert history_hits(text), f"not found: {text!r}"
    good = ["the kernel runs 4 warps per program", "it runs 8 iterations of the loop", "one pytest session",
            "the compression kernel is issue bound", "a run of 32 pools", "runs 2x faster", "run_notebook_cells.py",
            "tiles_s", "docs/semantics.md 6.1 (PR #57477)", "the select takes 11.8 us", "step NAME: rc=N",
            "the session's seed is printed", "STEPS=read bash benchmarks/gpu.sh", "--spec-tokens 4",
            "docs/semantics.md 5.4", "num_spec_tokens=3", "a spec decode vs plain"]
    for text in good:
        assert not history_hits(text), f"flagged: {text!r}: {history_hits(text)}"


def test_the_file_walk_finds_this_file_without_git(tmp_path, monkeypatch):
    """Without git the walk still lists the tree's files (here: a copy of a small tree
    where git cannot run) and leaves hidden and build folders out."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("text\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "b.py").write_text("y = 2\n")
    (tmp_path / "data.txt").write_text("not scanned\n")

    def no_git(*a, **kw):
        raise FileNotFoundError("git")
    monkeypatch.setattr(subprocess, "run", no_git)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tracked_files(tmp_path)) == ["notes.md", "pkg/a.py"]


def test_tree_has_no_history_labels():
    files = tracked_files()
    assert any(p.name == "test_tree_is_current.py" for p in files), "the scan does not see the tests"
    report = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rel = path.relative_to(ROOT).as_posix()
        report += [f"{rel}:{line}: {name}: {found!r}" for line, name, found in history_hits(text)]
    assert not report, (f"{len(report)} history labels in the tree (state the fact in the present tense; "
                        "measurements go to docs/benchmarks.md):\n" + "\n".join(report))
