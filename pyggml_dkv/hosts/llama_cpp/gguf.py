"""A target model's GGUF as the host needs it: metadata and dequantized tensors (the token
embedding and the output head), memory-mapped through the `gguf` package, as the drafter's own
GGUF reader (model/gguf_read.py) reads drafters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...model.gguf_names import GGUFError
from ...model.gguf_read import field_value, host_array

__all__ = ["GGUFError", "GGUFFile"]


class GGUFFile:
    """Metadata (`meta`) and tensors (`tensors`: name -> numpy-order shape, `array(name)`) of one
    GGUF file, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"no such GGUF file: {self.path}")
        try:
            from gguf import GGUFReader
        except ImportError as e:  # pragma: no cover - a dependency of the [llama] and [gguf] extras
            raise GGUFError("reading GGUF needs the `gguf` package (pip install gguf)") from e
        try:
            self._reader = GGUFReader(self.path, "r")
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path} is not a GGUF file ({e})") from e
        self.meta: dict[str, Any] = {
            name: field_value(f) for name, f in self._reader.fields.items() if not name.startswith("GGUF.")
        }
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.tensors = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in self._reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata, e.g. arch_value('block_count')."""
        return self.meta.get(f"{self.architecture}.{key}", default)

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, numpy order (rows of ne0 values)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise GGUFError(f"{self.path.name} has no tensor {name!r}")
        try:
            return host_array(tensor)
        except (NotImplementedError, ValueError) as e:
            raise GGUFError(f"tensor {name!r} ({tensor.tensor_type.name}) cannot be dequantized: {e}") from e
