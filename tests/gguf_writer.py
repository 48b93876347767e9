"""Writing small GGUF files for tests: metadata by Python type, then the file in GGUFWriter's order.

Shared by the GGUF reader tests, the tiny serve model and the SentencePiece
vocabulary, so all three lay out their fields the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gguf


def add_fields(writer: gguf.GGUFWriter, fields: Mapping[str, Any], *, int64: bool = False) -> None:
    """Each field typed by its Python value (bool before int, since bool is an int).

    Integers are uint32, as llama files store token ids; `int64` widens them
    for tests of the reader rather than of a model's layout.
    """
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            (writer.add_int64 if int64 else writer.add_uint32)(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def finish(writer: gguf.GGUFWriter) -> None:
    """Header, metadata, then tensors: the only order GGUFWriter accepts; then close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
