"""Read a config's YAML: PyYAML's safe loader, with numbers read as YAML 1.2 reads them and a key given twice in one
mapping refused.

- Floats: ``1e-3`` is a float (YAML 1.1, PyYAML's, wants ``1.0e-3`` and would give the string ``"1e-3"``, which a
  learning rate must not be).
- Integers: decimal, ``0o17`` or ``0x1f`` only. YAML 1.1 would read ``seed: 010`` as 8 (octal) and ``10:00`` as 600
  (base 60); here they are 10 and the string ``"10:00"``.
- A mapping that names a key twice (a second ``training:`` block) is an error naming both lines: YAML keeps only the
  last, so the first would be dropped without a word.

Strings, booleans and nulls are read as PyYAML reads them. This module reads text; it validates nothing else.
"""

from __future__ import annotations

import functools
import re

# YAML 1.2's core-schema numbers
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                    r"|\.(?:nan|NaN|NAN))$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def yaml_load(text: str):
    """The YAML document in ``text`` (see the module's docstring); raises ``yaml.YAMLError``."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass


def _construct_int(loader, node) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


@functools.cache
def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader with YAML 1.2's integers and floats, refusing a key given twice."""

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(
                            f"while reading a mapping (line {node.start_mark.line + 1})", node.start_mark,
                            f"the key {key_node.value!r} is given twice (lines {seen[key_node.value]} and "
                            f"{key_node.start_mark.line + 1}): YAML would keep only the last; merge the two",
                            key_node.start_mark)
                    seen[key_node.value] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    Loader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag != _INT_TAG]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
    Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+.0123456789"))
    Loader.add_constructor(_INT_TAG, _construct_int)
    return Loader
