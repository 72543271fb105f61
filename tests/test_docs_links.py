"""Every relative link in README.md, docs/ (history/ included) and benchmarks/ markdown resolves: the file exists and, for a
markdown target with a #fragment, the target has a heading with that GitHub anchor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.md")])

# [text](target) and ![alt](target); the target ends at whitespace (an optional "title") or ")".
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^\s)>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced and indented code blocks."""
    lines, fenced, previous_blank = [], False, True
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        indented_code = (
            line.startswith("    ") and previous_blank and not line.lstrip().startswith(("-", "|"))
        )
        previous_blank = (not line.strip()) or (indented_code and previous_blank)
        if fenced or indented_code:
            continue
        lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: link and emphasis markup dropped, lower case, every character
    other than a letter, digit, space, hyphen or underscore removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = "".join(c for c in text.strip().lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings, duplicates numbered -1, -2... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_anchor(match.group(1))
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_github_anchor_follows_githubs_rules() -> None:
    """The anchor helper gives GitHub's anchors for the heading shapes these pages use."""
    assert github_anchor("Training step") == "training-step"
    assert github_anchor("CUDA graphs over shapes (`cuda_graphs`, 2026-11-25)") == (
        "cuda-graphs-over-shapes-cuda_graphs-2026-11-25"
    )
    assert github_anchor("The head at B = 512, S = 32") == "the-head-at-b--512-s--32"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Each relative link of the page names an existing file, and each #fragment an existing heading."""
    broken = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            if not resolved.exists():
                broken.append(f"{target}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                broken.append(f"{target}: no heading with anchor #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
