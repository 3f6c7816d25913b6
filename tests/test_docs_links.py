"""Every relative link in the README and the docs resolves: the file (or folder) it names exists,
and a `#anchor` (into another page or the same one) names a heading of that page, slugged as
GitHub slugs headings. Fast, no services: it reads Markdown files only.

Pages checked: README.md, docs/*.md and the examples' pages (examples/*/*.md). Links inside
fenced code blocks and code spans are not links and are skipped, as are links with a scheme
(https:, mailto:) and autolinks.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "examples").glob("*/*.md"))]


FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (code spans' content, a link's
    text, no emphasis markers or HTML), lowercased, every character that is not a letter, digit,
    space, '-' or '_' removed, spaces to '-'."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub makes for the page: one per heading (a repeated slug gets -1, -2, ...)
    and explicit <a name/id> anchors."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text()):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(HTML_ANCHOR.findall(line))
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the page's prose."""
    out = []
    for number, line in prose_lines(page.read_text()):
        if m := REFERENCE_DEF.match(line):
            out.append((number, m.group(1)))
            continue
        stripped = CODE_SPAN.sub("", line)
        out.extend((number, target) for target in INLINE_LINK.findall(stripped))
    return out


def broken_links(root: Path) -> list[str]:
    """'page:line: target (why)' for every relative link under `root` that does not resolve."""
    problems = []
    for page in pages(root):
        if not page.exists():
            continue
        for number, target in links(page):
            if not target or SCHEME.match(target):
                continue
            where = f"{page.relative_to(root)}:{number}: {target}"
            path_part, _, anchor = target.partition("#")
            if path_part.startswith("/"):
                problems.append(f"{where} (absolute path; use a relative link)")
                continue
            dest = (page.parent / unquote(path_part)).resolve() if path_part else page
            if not dest.exists():
                problems.append(f"{where} (no such file)")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md" \
                    and unquote(anchor) not in anchors(dest):
                problems.append(f"{where} (no heading with that anchor in "
                                f"{dest.relative_to(root) if dest.is_relative_to(root) else dest})")
    return problems


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    problems = broken_links(REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_pages_have_links_to_check() -> None:
    readme = [t for _, t in links(REPO / "README.md") if not SCHEME.match(t)]
    assert any(t.startswith("docs/") for t in readme), readme
    assert any("#" in t for page in pages(REPO) for _, t in links(page))


def test_the_readme_starts_with_the_two_commands() -> None:
    """The README's first code block is the setup-and-train command and the test command, and
    both scripts exist."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block and text.index(block.group(0)) < text.index("\n## "), "no commands at the top"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["bash scripts/up.sh", "bash scripts/test.sh"], commands
    assert (REPO / "scripts" / "up.sh").is_file() and (REPO / "scripts" / "test.sh").is_file()


def test_the_readme_lists_every_page_recipe_and_bench() -> None:
    """The README's table of the docs has a line for each docs/*.md page, each example's
    README and each bench (bench/*.py, helpers starting with '_' aside)."""
    linked = {(REPO / unquote(t.partition("#")[0])).resolve()
              for _, t in links(REPO / "README.md") if not SCHEME.match(t)}
    wanted = [*sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*/*.md")),
              *sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))]
    missing = [str(p.relative_to(REPO)) for p in wanted if p.resolve() not in linked]
    assert not missing, f"README.md links none of: {missing}"


@pytest.mark.parametrize("heading, expected", [
    ("Measured: `bench/modes.py` on this 2-core CPU machine",
     "measured-benchmodespy-on-this-2-core-cpu-machine"),
    ("Malformed requests: 400, naming the field", "malformed-requests-400-naming-the-field"),
    ("Token in, token out", "token-in-token-out"),
    ("sync (`loop.train_sync`)", "sync-looptrain_sync"),
    ("Evaluation: `harnessrl eval`", "evaluation-harnessrl-eval"),
    ("Rollouts as **Kubernetes** Jobs", "rollouts-as-kubernetes-jobs"),
    ("A [linked](other.md) heading", "a-linked-heading"),
])
def test_slugs_follow_githubs_rules(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Twice\n\n## Twice\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[fine](docs/a.md) [fine too](docs/a.md#a-page) [second](docs/a.md#twice-1)\n"
        "[self](#top) [folder](docs/) [web](https://example.com/x.md#nowhere)\n"
        "`[in code](docs/missing.md)`\n\n"
        "```\n[in a fence](docs/missing.md)\n```\n\n"
        "[gone](docs/missing.md) [bad anchor](docs/a.md#nowhere) ![img](docs/img/x.png)\n"
        "[bad self](#bottom)\n")
    problems = broken_links(tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/missing.md (no such file)",
        "docs/a.md#nowhere (no heading with that anchor in docs/a.md)",
        "docs/img/x.png (no such file)",
        "#bottom (no heading with that anchor in README.md)",
    ], problems
