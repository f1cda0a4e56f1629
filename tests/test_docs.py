"""The documentation keeps up with the code: every flag of every command is documented in the
README or docs/, every relative link and anchor there resolves, and the README stays a short
front page that shows the test command CI runs (`make test`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NNUI_SUBCOMMANDS = ("status", "stop", "resume", "kill", "launch", "predict", "watch", "cv",
                    "priority", "export", "forget", "sbatch")  # fmt: skip
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: name -> "module:function"."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', table, flags=re.MULTILINE))


def help_texts() -> dict[str, str]:
    """`--help` of every console script and nnui subcommand, run side by side."""
    calls = {name: (target, ["--help"]) for name, target in console_scripts().items()}
    nnui = console_scripts()["nnui"]
    calls |= {f"nnui {sub}": (nnui, [sub, "--help"]) for sub in NNUI_SUBCOMMANDS}
    code = "import importlib, sys; m, f = sys.argv[1].split(':'); " \
           "sys.exit(getattr(importlib.import_module(m), f)(sys.argv[2:]))"  # fmt: skip
    running = {name: subprocess.Popen([sys.executable, "-c", code, target, *args], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (target, args) in calls.items()}  # fmt: skip
    texts = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, (name, err[-500:])
        texts[name] = out
    return texts


def mentioned(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_flag_of_every_command_is_documented() -> None:
    documented = "\n".join(path.read_text() for path in DOCS)
    missing = {}
    for name, text in help_texts().items():
        flags = set(FLAG.findall(text))
        flags -= {"-h", "--help"}
        absent = sorted(f for f in flags if not mentioned(f, documented))
        if absent:
            missing[name] = absent
    assert missing == {}


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in path.read_text().splitlines():
        if match := re.match(r"#+\s+(.*)", line):
            anchors.add(re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            linked = (path.parent / target).resolve() if target else path
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                broken.append(f"{path.name}: {target}#{anchor}")
    assert broken == []


def test_the_readme_is_a_short_front_page_with_the_ci_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert re.search(r"^make test\b", readme, flags=re.MULTILINE)  # .ci/run runs `make test`
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_code_points_to_docs_pages_not_to_design_sections() -> None:
    """Comments name a page under docs/ (in the repository), never a section of a design
    document outside it; a docs/ page a comment names exists."""
    stale, missing = [], []
    for folder in ("app", "trainer", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(ROOT)
            stale += [f"{where}" for _ in re.finditer("DESIGN" + r" \u00a7", text)]
            missing += [f"{where}: {m}" for m in set(re.findall(r"docs/[\w-]+\.md", text))
                        if not (ROOT / m).is_file()]  # fmt: skip
    assert stale == [] and missing == []


def mapped_paths(page: Path) -> set[str]:
    """The files a module map names: its code blocks drawn as trees (`app/`, then indented
    `screens/`, then `seam.py`), each name joined to the folders above it."""
    found: set[str] = set()
    for block in re.findall(r"```\n(.*?)```", page.read_text(), re.S):
        stack: list[tuple[int, str]] = []
        for line in block.splitlines():
            match = re.match(r"( *)([\w.]+/|[\w.]+\.py)(\s|$)", line)
            if not match:
                continue
            indent, name = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if name.endswith("/"):
                stack.append((indent, name))
            else:
                found.add("".join(folder for _, folder in stack) + name)
    return found


@pytest.mark.parametrize(
    ("package", "page"), [("app", "layout-app.md"), ("trainer", "layout-trainer.md")]
)
def test_the_module_maps_list_every_module(package: str, page: str) -> None:
    listed = mapped_paths(ROOT / "docs" / page)
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py")
               if p.name != "__init__.py"}  # fmt: skip
    assert sorted(modules - listed) == []
    assert sorted(m for m in listed - modules if m.startswith(package + "/")) == []
