"""Command-line flags from an example's ``Args`` dataclass: one ``--flag`` per field, its default the field's, its
help the text in the field's ``Annotated[type, "help"]``. A boolean field is a ``--x / --no-x`` pair, so a default of
True can be turned off and a default of False on.

The examples import this module from their own folder (``llmrl run`` puts a script's folder on the path, as Python
does). It parses; what a flag does is the example's.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import get_type_hints


def flags_parser(args_class, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with one flag per field of the dataclass ``args_class``."""
    parser = argparse.ArgumentParser(description=description)
    helps = {name: hint.__metadata__[0] for name, hint in get_type_hints(args_class, include_extras=True).items()}
    for name, value in asdict(args_class()).items():
        flag, text = "--" + name.replace("_", "-"), helps[name].replace("%", "%%")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=text)  # --x / --no-x
        else:
            parser.add_argument(flag, type=type(value), default=value, help=text)
    return parser
