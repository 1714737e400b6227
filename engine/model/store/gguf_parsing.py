"""Parse a GGUF file once while transformers converts it.

transformers reads a GGUF file three times to build a model and its tokenizer (the tokenizer's config, the model's
config, then the weights), and each read parses every metadata field in Python: SmolLM2's 49,152-token vocabulary
and its merges are some 440,000 values, about 4 CPU-seconds a read. It also builds ``gguf``'s tensor-name table
anew for every module of the model (some 400 times). :func:`parsed_once` shares one parsed reader per file, and one
table per (architecture, layer count), for the duration of a ``with`` block: the same objects transformers would
have built, built once. Both are read-only to transformers (it reads fields, tensors and names; it writes none).

This module memoizes two ``gguf`` functions inside a block; it converts nothing and reads no file itself.
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def parsed_once():
    """Inside the block, ``gguf.GGUFReader(path)`` returns one reader per file and ``gguf.get_tensor_name_map`` one
    table per arguments; both are restored after it, whatever happens inside."""
    import gguf

    make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    name_maps: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = make_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map
