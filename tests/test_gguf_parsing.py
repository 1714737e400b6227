""":func:`llmrl.engine.model.store.gguf_parsing.parsed_once`: one parsed reader per GGUF file and one tensor-name
table per (architecture, layer count) inside the block, the ``gguf`` package's own functions outside it. The model it
speeds up is checked whole against its GGUF file in ``test_builtin_smollm2.py``."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _write_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_reader_per_file_and_one_name_table_inside_the_block_only(tmp_path):
    from llmrl.engine.model.store.gguf_parsing import parsed_once

    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(first)
    _write_gguf(second)
    reader_class, name_map_function = gguf.GGUFReader, gguf.get_tensor_name_map
    with parsed_once():
        from gguf import GGUFReader, get_tensor_name_map  # as transformers imports them, inside its functions

        reader = GGUFReader(first)
        assert GGUFReader(str(first)) is reader and GGUFReader(second) is not reader
        np.testing.assert_array_equal(reader.tensors[0].data.reshape(3, 4), np.arange(12).reshape(3, 4))
        table = get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table
        assert get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not table
        assert table.get_name("model.embed_tokens") == "token_embd"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map_function)
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)  # outside: parsed anew each time

    with pytest.raises(RuntimeError), parsed_once():
        raise RuntimeError("a failed conversion")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map_function)
