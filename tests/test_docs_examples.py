"""Every ```python block of the README and the guide pages runs.

A page's blocks run in order in one namespace (a later block may use what an
earlier one built), in a fresh temporary directory, so a guide reads as one
session. A block that cannot run here (a download, a side environment) is marked
on the line before its fence, with the reason:

    <!-- docs-test: skip: downloads larq-zoo's ImageNet weights -->

and a block that needs a name the code does not have yet (a module being written)
with the name, so it runs as soon as the name exists:

    <!-- docs-test: requires tapehook.zoo.QuickNetSmall -->
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The README, Getting started and the guides (mkdocs.yml's nav): the pages a user
# copies code from. Reference pages (design, formats) hold no runnable examples.
PAGES = [
    ROOT / "README.md",
    DOCS / "index.md",
    *sorted((DOCS / "guides").glob("*.md")),
    DOCS / "recipes.md",
    DOCS / "deploy.md",
    DOCS / "larq.md",
]
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
MARKER = re.compile(r"<!-- docs-test: (skip|requires)[: ]\s*(.+?)\s*-->")


def blocks(page):
    """[(line, code, marker)] of a page's python blocks; marker: (kind, text) or None."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        out.append((line, match.group(1), marker.groups() if marker else None))
    return out


def _exists(dotted):
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path, monkeypatch):
    import keras

    monkeypatch.chdir(tmp_path)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    namespace = {"__name__": "__docs__"}
    ran = 0
    for line, code, marker in blocks(page):
        if marker and marker[0] == "skip":
            continue
        if marker and marker[0] == "requires" and not _exists(marker[1]):
            continue
        exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        ran += 1
    assert ran or not blocks(page), f"{page.name}: every example is skipped"


def test_markers_are_rare_and_say_why():
    marked = [(p.name, line, m) for p in PAGES for line, _, m in blocks(p) if m]
    total = sum(len(blocks(p)) for p in PAGES)
    assert all(len(m[1]) > 10 for _, _, m in marked if m[0] == "skip"), marked
    assert all(re.fullmatch(r"tapehook(\.\w+)+", m[1]) for _, _, m in marked if m[0] == "requires")
    assert len(marked) <= total // 4, f"{len(marked)} of {total} examples do not run: {marked}"


def test_blocks_are_found(tmp_path):
    """The extractor sees fences, markers and line numbers as written."""
    page = tmp_path / "sample.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\ntext\n"
        "<!-- docs-test: skip: needs the network -->\n```python\nboom()\n```\n"
        "```bash\nls\n```\n"
    )
    assert blocks(page) == [(3, "x = 1\n", None), (9, "boom()\n", ("skip", "needs the network"))]
