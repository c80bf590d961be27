"""The documentation: the site builds strictly, nothing points outside the repository, and what the
user-facing pages name (links, anchors, paths, command-line flags, Python names, snippets) exists."""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import re
import runpy
import subprocess
import sys
import textwrap
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: The pages a user follows: the README and docs/*.md, not the benchmark log or the decisions.
USER_DOCUMENTS = [
    ROOT / "README.md",
    *(path for path in sorted((ROOT / "docs").glob("*.md")) if path.name != "benchmarks.md"),
]
#: Flags the pages show for other programs (``mypy --strict``).
OTHER_PROGRAMS_FLAGS = frozenset({"--strict"})
#: Dotted names that are loggers, spans or span attributes, not Python objects.
NOT_PYTHON_NAMES = frozenset(
    {
        "codemode.cells",
        "codemode.cell",
        "codemode.cell_id",
        "codemode.outcome",
        "codemode.tool",
        "codemode.tool_call",
        "codemode.tool_call_id",
        "codemode.wait",
    }
)
_FENCE = re.compile(r"^(```|~~~)")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.timeout(300)
def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav exists, every link and anchor resolves,
    every API reference block renders."""
    done = subprocess.run(
        # Not --quiet: it hides the warnings that --strict turns into a failure.
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "python-api" / "index.html").is_file()


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_documents_stand_alone(document: Path) -> None:
    """A user's checkout has no ``../shared``: no document may send a reader there."""
    text = document.read_text()
    assert "../shared" not in text and "/work/" not in text


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's ``toc``) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(document: Path) -> set[str]:
    return {
        _slug(match)
        for match in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _prose(document.read_text()), re.M)
    }


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_name)
def test_relative_links_resolve(document: Path) -> None:
    """Every relative link leads to a file of the checkout, and its anchor to a heading there
    (the README is not part of the site, so ``mkdocs build`` does not check it)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(document.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        assert linked.exists(), f"{target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{target}: no heading with that anchor"


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_name)
def test_paths_named_exist(document: Path) -> None:
    """A repository path in backticks (``tests/contract/``, ``examples/tools.py``) exists."""
    prefixes = ("src/", "tests/", "docs/", "examples/", "benchmarks/", "scripts/", ".ci/")
    for span in re.findall(r"`([^`\s]+)`", document.read_text()):
        if span.startswith(prefixes) and not re.search(r"[A-Z]{3,}|…|\*", span):
            assert (ROOT / span).exists(), span


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of ``parser`` and of every subcommand below it."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(option for option in action.option_strings if option.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= _option_strings(child)
    return found


def _all_options() -> set[str]:
    from codemode.cli import _parser
    from codemode.cli.codex_host import _parser as codex_host_parser

    return _option_strings(_parser()) | _option_strings(codex_host_parser())


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_name)
def test_every_flag_named_exists(document: Path) -> None:
    """Each ``--flag`` a page shows is an option of ``codemode`` or ``codex-code-mode-host``."""
    unknown = _flags(document.read_text()) - _all_options() - OTHER_PROGRAMS_FLAGS
    assert not unknown, f"not an option of any command: {sorted(unknown)}"


def test_the_command_line_page_names_every_option() -> None:
    """docs/cli.md says what every option of every command is for (``--help`` aside)."""
    missing = _all_options() - {"--help"} - _flags((ROOT / "docs" / "cli.md").read_text())
    assert not missing, f"options docs/cli.md does not mention: {sorted(missing)}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                target = getattr(target, part)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_name)
def test_python_names_exist(document: Path) -> None:
    """Each ``codemode.…`` name in backticks is a module or an attribute of one."""
    names = set(re.findall(r"`(codemode(?:\.\w+)+)", document.read_text())) - NOT_PYTHON_NAMES
    unknown = sorted(name for name in names if not _resolves(name))
    assert not unknown, unknown


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_name)
def test_python_snippets_compile(document: Path) -> None:
    """Every ``python`` block is valid Python (top-level ``await`` allowed: some snippets show the
    body of a coroutine)."""
    for block in _code_blocks(document.read_text(), "python"):
        compile(block, _name(document), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.timeout(60)
def test_the_session_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/python-api.md: the "Sessions" snippet, with the ``registry`` of the agent loop above
    it, runs a cell that calls that registry's tool."""
    blocks = _code_blocks((ROOT / "docs" / "python-api.md").read_text(), "python")
    loop = next(block for block in blocks if "@registry.tool" in block)
    session = next(block for block in blocks if "LocalSessionProvider" in block)
    namespace: dict[str, object] = {}
    exec(compile(loop, "python-api.md", "exec"), namespace)  # defines `registry`
    source = "async def snippet() -> None:\n" + textwrap.indent(session, "    ")
    exec(compile(source, "python-api.md", "exec"), namespace)
    asyncio.run(namespace["snippet"]())  # type: ignore[operator]
    printed = capsys.readouterr().out
    assert "error_text=None" in printed and "Oslo" in printed, printed


@pytest.mark.timeout(60)
def test_the_tools_page_snippets_run(tmp_path: Path) -> None:
    """docs/tools.md: every ``python`` block runs as shown, on its own, as a module (compiling
    alone let snippets that call names they never define through: ``get_time``,
    ``slow_report_tool``). The MCP block is left out: it starts ``uvx mcp-server-time`` from the
    network."""
    blocks = _code_blocks((ROOT / "docs" / "tools.md").read_text(), "python")
    ran = 0
    for number, block in enumerate(blocks):
        if "mcp_tools(" in block:
            continue
        snippet = tmp_path / f"tools_md_{number}.py"
        snippet.write_text(block)
        runpy.run_path(str(snippet), run_name=snippet.stem)
        ran += 1
    assert ran == len(blocks) - 1
