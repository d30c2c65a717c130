"""llama-cpp-python's low-level handles we use beyond its own ctypes bindings.

- `libllama`, `libggml`: the shared libraries llama_cpp already loaded (ctypes handles on them);
  we call llama.cpp's own ggml (never ours) to read its tensors.
- the two C++-linkage functions llama.cpp exports for its native DFlash feature extraction
  (`llama_set_embeddings_layer_inp`, `llama_get_embeddings_layer_inp`), found by their mangled
  names; `native_layer_inp()` returns None when this build lacks them.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp
import llama_cpp._ggml as _ggml

# struct ggml_tensor: enum type (4, padded to 8), buffer*, int64 ne[4], size_t nb[4], ...
TENSOR_NE_OFFSET = 16


@functools.cache
def libggml() -> ctypes.CDLL:
    lib = _ggml.libggml
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_void_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


def libllama() -> ctypes.CDLL:
    return llama_cpp.llama_cpp._lib


@dataclass(frozen=True)
class NativeLayerInp:
    # ctypes function pointers (typeshed names no public type for them)
    set: Callable[..., None]  # (llama_context*, uint32 lid, bool enable) -> void
    get: Callable[..., Any]  # (llama_context*, uint32 lid) -> float*


# Itanium C++ ABI names of
#   void    llama_set_embeddings_layer_inp(llama_context *, uint32_t, bool)
#   float * llama_get_embeddings_layer_inp(llama_context *, uint32_t)
_SET_MANGLED = b"_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
_GET_MANGLED = b"_Z30llama_get_embeddings_layer_inpP13llama_contextj"


@functools.cache
def native_layer_inp() -> NativeLayerInp | None:
    lib = libllama()
    try:
        set_fn = getattr(lib, _SET_MANGLED.decode())
        get_fn = getattr(lib, _GET_MANGLED.decode())
    except AttributeError:
        return None
    set_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
    set_fn.restype = None
    get_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    get_fn.restype = ctypes.POINTER(ctypes.c_float)
    return NativeLayerInp(set_fn, get_fn)
