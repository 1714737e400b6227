"""Write the generated reference pages: each module ``docs/generators/<name>.py`` defines ``render() -> str``, whose
markdown is committed as ``docs/reference/<name>.md``.

    python docs/generate.py           # rewrite every generated page
    python docs/generate.py --check   # exit 1 naming the pages that differ from what their generator renders

Generators are loaded by file path (``docs/`` is no package). This script writes only ``docs/reference/<name>.md``
for the generators it finds; it builds no site (``mkdocs build`` does) and does not render ``reference/api.md``
(mkdocstrings does, from the docstrings, at build time).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
GENERATORS = DOCS / "generators"
REFERENCE = DOCS / "reference"
COMMAND = "python docs/generate.py"


def generators() -> dict[str, Path]:
    """Every generator module by page name, in name order."""
    return {path.stem: path for path in sorted(GENERATORS.glob("*.py")) if not path.stem.startswith("_")}


def render(name: str) -> str:
    """The markdown the generator ``name`` renders now."""
    path = generators()[name]
    spec = importlib.util.spec_from_file_location(f"llmrl_docs_generator_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.render()
    return text if text.endswith("\n") else text + "\n"


def page(name: str) -> Path:
    return REFERENCE / f"{name}.md"


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    return str(path.relative_to(DOCS.parent)) if path.is_relative_to(DOCS.parent) else str(path)


def stale() -> list[str]:
    """The generated pages whose committed text is not what their generator renders now (or that are missing)."""
    return [name for name in generators() if not page(name).exists() or page(name).read_text() != render(name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="write (or check) the generated reference pages")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"stale: {shown(page(name))} (regenerate with `{COMMAND}`)", file=sys.stderr)
        return 1 if names else 0
    REFERENCE.mkdir(exist_ok=True)
    for name in generators():
        text = render(name)
        if not page(name).exists() or page(name).read_text() != text:
            page(name).write_text(text)
            print(f"wrote {shown(page(name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
