"""Serving: generation for many clients, and ggml's RPC server.

- `engine.SpeculativeEngine`: continuous batching with speculative decoding over a multi-sequence
  target and a multi-lane drafter (`requests`: a request's parameters, handle and statistics;
  `policy`: the draft length of each request and round; `calibration`: the costs it starts from).
  The HTTP front is `pyggml_dkv.serve`.
- ggml's RPC server, so a drafter on another machine can compute here:
  `python -m pyggml_dkv.serving.rpc_server --host 127.0.0.1 --port N --threads T --device cpu`
(see rpc_server), or from Python `serve(...)` (blocking, in this process) and
`RpcServerProcess(...)` (a child process, used by the tests and the benchmark).
"""

from __future__ import annotations

from .rpc_server import RpcServerError, RpcServerProcess, serve

__all__ = ["RpcServerError", "RpcServerProcess", "serve"]
