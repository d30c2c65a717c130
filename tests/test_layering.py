"""The package's layers, enforced: imports point one way only, and nothing imports in a circle.

Layers, bottom up (docs/design.md, "Layers"): `common` < `ggml`, `model` < `reference`,
`drafter` < `hosts`, `serving` < `training`, `serve`. Every import counts, at module level or deferred inside a
function; only `if TYPE_CHECKING:` blocks (never run) are left out. The package's `__init__`
is the facade that re-exports the public API lazily and may name any layer; `llama`
(pyggml_dkv/llama.py) is the facade of the llama-cpp-python host's one-call entry point.

`model` needs no ggml: every one of its modules imports (and reads, writes and checks drafter
files) where the compiled extension cannot load. Its only imports outside `common` are the deferred
ones of DEFERRED_UPWARD, each with its reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.child import run_in_child

PACKAGE = Path(__file__).resolve().parents[1] / "pyggml_dkv"

# layer -> the layers its modules may import (besides their own)
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "_cffi": set(),  # the build script of the extension: cffi only
    "ggml": {"common", "_ggml_cffi", "_cffi"},  # _cffi.stamp: the build stamp checked at import
    "model": {"common"},  # and the deferred imports of DEFERRED_UPWARD
    "reference": {"common", "model"},
    "drafter": {"common", "ggml", "model"},
    "hosts": {"common", "ggml", "model", "drafter", "reference"},
    "serving": {"common", "ggml", "model", "drafter"},
    "training": {"common", "ggml", "model", "reference", "drafter", "hosts"},
    "serve": {"common", "ggml", "model", "drafter", "hosts", "serving"},  # the HTTP server: wires a host to the engine
    "llama": {"hosts"},  # pyggml_dkv.llama: speculative_llama, re-exported from hosts.llama_cpp.speculative
}


# (module, the module it imports) -> why: imports against ALLOWED that are made inside a function
# only, so the importing module itself still imports without the target's layer
DEFERRED_UPWARD: dict[tuple[str, str], str] = {
    (
        "pyggml_dkv.model.weights",
        "pyggml_dkv.drafter.backend_weights",
    ): "DraftWeights.to_backend, the one-call upload, builds the drafter layer's BackendWeights",
    (
        "pyggml_dkv.model.gguf_write",
        "pyggml_dkv.ggml.types",
    ): "a quantized GGUF is written with ggml's own quantizer (the gguf package has none for the k-quants)",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(path: Path, deferred: bool = True) -> set[str]:
    """Absolute names of the pyggml_dkv modules `path` imports, anywhere in its body (`deferred`),
    or only those that importing it imports (outside every function)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if is_type_checking_block(node):
            return
        if not deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pyggml_dkv"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("pyggml_dkv"):
                # `from . import layers` names a module; `from .x import y` names module x
                candidates = [f"{target}.{a.name}" for a in node.names]
                found.update(
                    c
                    if (PACKAGE.parent / (c.replace(".", "/") + ".py")).exists()
                    or (PACKAGE.parent / c.replace(".", "/")).is_dir()
                    else target
                    for c in candidates
                )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package facade


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_layer():
    graph = import_graph()
    stray = sorted(m for m in graph if layer_of(m) not in ALLOWED and m != "pyggml_dkv")
    assert not stray, f"modules outside every layer: {stray}"


def test_imports_point_down_only():
    wrong = []
    for module, imports in import_graph().items():
        layer = layer_of(module)
        if layer is None:
            continue
        for target in imports:
            target_layer = layer_of(target)
            if target_layer != layer and target_layer not in ALLOWED[layer] and (module, target) not in DEFERRED_UPWARD:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_the_allowed_upward_imports_are_deferred_and_still_made():
    graph = import_graph()
    module_level = {module_name(p): imported_modules(p, deferred=False) for p in sorted(PACKAGE.rglob("*.py"))}
    for (module, target), why in DEFERRED_UPWARD.items():
        assert target in graph[module], f"{module} no longer imports {target}: drop its DEFERRED_UPWARD entry"
        assert target not in module_level[module], f"{module} imports {target} at module level ({why}): defer it"


def test_no_import_cycles():
    graph = import_graph()
    known = set(graph)

    def resolve(target: str) -> str | None:  # `pyggml_dkv.ggml.Backend`-style names -> their module
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    edges = {
        m: {t for t in map(resolve, imports) if t and t != m and not m.startswith(t + ".")}
        for m, imports in graph.items()
    }
    # (a module importing its own parent package is left out: Python imports parents first anyway)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                dfs(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    """The checks above would pass vacuously if the parser missed imports: prove it does not."""
    weights = PACKAGE / "model" / "weights.py"
    imports = imported_modules(weights)
    assert "pyggml_dkv.drafter.backend_weights" in imports  # deferred, inside to_backend()
    assert "pyggml_dkv.drafter.backend_weights" not in imported_modules(weights, deferred=False)
    assert "pyggml_dkv.model.checkpoint" in imports  # relative, at module level
    assert "pyggml_dkv.model.checkpoint" in imported_modules(weights, deferred=False)
    assert "pyggml_dkv.ggml" not in imports  # under TYPE_CHECKING only


def run_without_the_extension(layer: str) -> None:
    """Child side: block the compiled ggml extension, import `layer` (and every module of it),
    run a reference step; for `model`, read the shipped GGUF drafter and write it back as f16."""
    import importlib
    import pkgutil
    import tempfile

    sys.modules["pyggml_dkv._ggml_cffi"] = None  # type: ignore[assignment]  # importing it now raises ImportError
    import numpy as np

    package = importlib.import_module(layer)
    for info in pkgutil.walk_packages(package.__path__, f"{layer}."):
        importlib.import_module(info.name)
    from pyggml_dkv import DraftConfig, DraftWeights
    from pyggml_dkv import reference as R

    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=0)
    rng = np.random.default_rng(0)
    out = R.reference_step(
        w, rng.standard_normal((40, cfg.fc_in)), 40, 32, rng.standard_normal((cfg.block_size, cfg.hidden))
    )
    assert out.shape == (cfg.block_size, cfg.hidden) and np.isfinite(out).all()
    if layer == "pyggml_dkv.model":  # the files: the shipped q8_0 GGUF read (its stored blocks checked), f16 written
        shipped = PACKAGE / "hosts" / "pretrained" / "smollm2-135m-dflash.gguf"
        g = DraftWeights.from_pretrained(shipped)
        assert g.stored and {m.type_name for m in g.stored.values()} == {"q8_0"}
        from tests.model.gguf_helpers import write_vocab_gguf

        toy = DraftWeights.random(DraftConfig.toy(mask_token_id=3, target_layer_ids=[1, 4, 7]), seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            vocab = write_vocab_gguf(Path(tmp) / "target.gguf", 128)
            again = DraftWeights.from_pretrained(toy.save_pretrained(tmp, format="gguf", dtype="f16", vocab_from=vocab))
            assert again.cfg.hidden == toy.cfg.hidden and {m.type_name for m in again.stored.values()} == {"f16"}
            try:  # quantizing is ggml's (DEFERRED_UPWARD)
                toy.save_pretrained(tmp, format="gguf", dtype="q8_0", vocab_from=vocab)
                raise AssertionError("a q8_0 GGUF was written without ggml")
            except ImportError:
                pass
        try:  # and so is the upload (DEFERRED_UPWARD)
            w.to_backend(None)  # type: ignore[arg-type]
            raise AssertionError("to_backend ran without ggml")
        except ImportError:
            pass
    assert "pyggml_dkv.ggml" not in sys.modules
    try:
        import pyggml_dkv.ggml  # noqa: F401
    except ImportError:
        print("ok")


@pytest.mark.parametrize("layer", ["pyggml_dkv.reference", "pyggml_dkv.model"])
def test_reference_and_model_stand_alone_without_the_ggml_extension(layer):
    """The numpy oracle and the model (every module of both, the drafter files read and written) must
    work where the compiled ggml cannot load."""
    done = run_in_child("tests.test_layering:run_without_the_extension", layer, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_every_error_the_package_raises_on_purpose_derives_from_the_base():
    import pyggml_dkv
    from pyggml_dkv.ggml import BackendUnavailableError, GGMLError
    from pyggml_dkv.hosts.llama_cpp import HostClosedError, HostError, IncompatibleDrafterError
    from pyggml_dkv.hosts.smollm2 import ModelUnavailableError

    for error in (
        pyggml_dkv.ConfigError,
        pyggml_dkv.WeightsError,
        pyggml_dkv.CheckpointError,
        pyggml_dkv.CheckpointNotFoundError,
        GGMLError,
        BackendUnavailableError,
        HostError,
        HostClosedError,
        IncompatibleDrafterError,
        ModelUnavailableError,
    ):
        assert issubclass(error, pyggml_dkv.PyggmlDkvError), error
    assert issubclass(pyggml_dkv.ConfigError, ValueError) and issubclass(GGMLError, RuntimeError)
    assert issubclass(pyggml_dkv.CheckpointNotFoundError, FileNotFoundError)
