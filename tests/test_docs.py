"""The docs a user reads: every command's --help ends with its examples and the name of an existing page
of docs/, and the README and docs/ link only to files that exist inside the repository."""

import re

import pytest
import typer
from typer.testing import CliRunner

from conftest import REPO
from terra_cli.cli import app

DOCS_PAGE = re.compile(r"\b(docs/[\w-]+\.md)\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _is_group(command) -> bool:
    return hasattr(command, "commands")  # typer vendors its own click: no isinstance on click's classes


def _commands(command, path=()):
    yield path, command
    if _is_group(command):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))


COMMANDS = [path for path, _ in _commands(typer.main.get_command(app))]


def test_every_command_is_listed():
    assert {("generate",), ("serve",), ("bench",), ("eval",), ("info",), ("tokenize",), ("actions", "convert"),
            ("actions", "plot"), ("refine", "video"), ("refine", "convert")} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "terra")
def test_help_ends_with_examples_and_an_existing_docs_page(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "160", "TERMINAL_WIDTH": "160"})
    assert result.exit_code == 0, result.output
    lines = [line.strip(" │╭╮╰╯─") for line in result.output.splitlines()]
    lines = [line for line in lines if line]
    assert lines[-1].startswith("Docs:"), f"`terra {' '.join(path)} --help` ends with {lines[-1]!r}"
    assert any(line.startswith("Example") for line in lines), "no examples"  # groups and the root too
    assert any(line.startswith("terra ") for line in lines[lines.index(next(
        line for line in lines if line.startswith("Example"))):]), "examples name no terra command"
    if path == ():  # the root names the README and the folder
        return
    pages = DOCS_PAGE.findall(lines[-1])
    assert pages, lines[-1]
    for page in pages:
        assert (REPO / page).is_file(), f"`terra {' '.join(path)} --help` names {page}, which does not exist"


@pytest.mark.parametrize("path", [path for path in COMMANDS if path], ids=lambda path: " ".join(path))
def test_help_paragraphs_are_not_broken_where_the_source_wraps(path):
    # rich help prints a docstring's line breaks as they are: a summary wrapped at the source's width comes
    # out as a ragged line in the middle of a sentence, at any terminal width
    command = dict(_commands(typer.main.get_command(app)))[path]
    text = (command.help or "").strip()
    for paragraph in text.split("\n\n"):
        assert "\n" not in paragraph.strip(), f"`terra {' '.join(path)} --help` breaks a paragraph: {paragraph!r}"


def _markdown_files():
    return [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]


def test_docs_link_only_to_files_inside_the_repository():
    for page in _markdown_files():
        for target in MARKDOWN_LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            resolved = (page.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(REPO), f"{page.name} links outside the repository: {target}"
            assert resolved.exists(), f"{page.name} links to {target}, which does not exist"
    for page in sorted((REPO / "docs").glob("*.md")):
        assert "../shared" not in page.read_text(), f"{page.name} names a file outside the repository"


def test_every_docs_page_is_reachable_from_the_readme_or_another_page():
    linked = set()
    for page in _markdown_files():
        for target in MARKDOWN_LINK.findall(page.read_text()):
            linked.add((page.parent / target.split("#")[0]).resolve())
    for page in sorted((REPO / "docs").glob("*.md")):
        assert page.resolve() in linked, f"nothing links to docs/{page.name}"


def test_readme_stays_a_five_minute_read():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
