"""The layout block of docs/explanation/architecture.md against the tree: every module it names exists (where the
block puts it), and every package folder and module of ``engine/``, ``plugins/`` and ``launch/`` is in it (a new
module is named there, a removed or moved one leaves it). Read from the files; nothing is imported; the block's
prose is not checked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "explanation" / "architecture.md"
FOLDER = re.compile(r"(?<![\w./:])(\w+(?:/\w+)*)/(?=[\s),;:]|$)")  # engine/, tests/testkit/ (not tinker://)
MODULE = re.compile(r"(?<![\w./])(\w+(?:/\w+)*\.py)\b")


def layout_block() -> list[str]:
    """The lines of the code block under ``## Layout``."""
    text = PAGE.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return text.split("```", 2)[1].splitlines()[1:]


def named() -> tuple[list[tuple[str, str]], set[str]]:
    """The modules the block names, each as a path from the root to the folder it is named under (the file may lie
    deeper: ``tracker.py`` under ``engine/client/``), and the folders it names, as paths from the root.

    A line that starts at indent 0, 2 or 4 begins an entry: with a folder (``engine/``, ``client/``,
    ``decoding/``) it opens that folder under the entry one level up; without one (``errors.py ...`` at indent 2)
    it is the folder one level up. Other lines go on with the entry above. A top-level folder named within a line
    (``examples/``) opens it."""
    modules, folders = [], set()
    stack: list[str] = []  # the open folder at each level
    for line in layout_block():
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent in (0, 2, 4):
            level = indent // 2
            first = FOLDER.match(line.strip())
            stack = stack[:level] + ([first.group(1)] if first else [])
        for match in sorted([*FOLDER.finditer(line), *MODULE.finditer(line)], key=lambda m: m.start()):
            token = match.group(1)
            if token.endswith(".py"):
                modules.append((token, "/".join(stack)))
            elif (ROOT / token.split("/")[0]).is_dir() and match.start() > indent:  # examples/, tests/testkit/
                stack = token.split("/")[:1]
                folders.add(token)
            else:
                folders.add("/".join([*stack[:-1], token]) if match.start() == indent else "/".join([*stack, token]))
    return modules, folders


def test_every_module_the_layout_names_exists_where_it_says():
    modules, _ = named()
    assert len(modules) > 100  # the block was found and read
    missing = [f"{name} (under {folder}/)" for name, folder in modules
               if not any((ROOT / folder).rglob(name.rpartition("/")[2]))]
    assert missing == [], f"{PAGE.relative_to(ROOT)}'s layout names modules that do not exist"


def package_files(name: str) -> list[Path]:
    """The files called ``name`` in the packages ``engine``, ``plugins`` and ``launch``."""
    return sorted(path for top in ("engine", "plugins", "launch") for path in (ROOT / top).rglob(name)
                  if "build" not in path.relative_to(ROOT).parts)


def test_every_package_folder_is_in_the_layout():
    _, folders = named()
    packages = [init.parent.relative_to(ROOT).as_posix() for init in package_files("__init__.py")]
    assert len(packages) > 10
    assert [p for p in packages if p not in folders] == [], f"{PAGE.relative_to(ROOT)}'s layout leaves them out"


def test_every_module_of_the_packages_is_in_the_layout():
    modules, _ = named()
    places = {(name.rpartition("/")[2], folder) for name, folder in modules}
    left_out = [path.relative_to(ROOT).as_posix() for path in package_files("*.py") if path.name != "__init__.py"
                and not any((path.name, folder) in places for folder in map(str, path.relative_to(ROOT).parents))]
    assert left_out == [], f"{PAGE.relative_to(ROOT)}'s layout leaves them out: name each where its folder is"
