"""The public API: each package's `__all__` is exactly its documented list, every name resolves,
`import pyggml_dkv` stays cheap, no raw cffi object or patch constant is public, and the examples
import only public names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TOP = [
    "Backend",
    "DraftConfig",
    "DraftKvCache",
    "DraftWeights",
    "Drafter",
    "FeatureRing",
    "OneShotDrafter",
    "PyggmlDkvError",
    "load_checkpoint",
    "load_gguf",
    "speculative_llama",
]
GGML = [
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "Buffer",
    "Context",
    "GGMLError",
    "Gallocr",
    "Graph",
    "RemoteBackendError",
    "TYPES",
    "Tensor",
    "available_backends",
    "dequantize",
    "list_devices",
    "live_objects",
    "quantize",
    "version",
]
LLAMA_CPP = [
    "DFlashLlamaDraftModel",
    "GGUFFile",
    "GenerationConfig",
    "GenerationResult",
    "HostClosedError",
    "HostError",
    "HybridDrafter",
    "IncompatibleDrafterError",
    "LlamaTarget",
    "OracleDrafter",
    "ReferenceDrafter",
    "RemoteDrafter",
    "SpeculativeGenerator",
    "check_fits_gguf",
    "compare_to_plain",
    "ggml_drafter",
    "plain_greedy",
    "random_smollm2_weights",
    "smollm2_draft_config",
    "smollm2_drafter_path",
    "smollm2_gguf",
    "target_embeddings",
]
LLAMA = ["speculative_llama"]
PUBLIC = {
    "pyggml_dkv": TOP,
    "pyggml_dkv.ggml": GGML,
    "pyggml_dkv.hosts.llama_cpp": LLAMA_CPP,
    "pyggml_dkv.llama": LLAMA,
}
# names that resolve only with llama-cpp-python installed (their modules import llama_cpp)
NEEDS_LLAMA_CPP = {"DFlashLlamaDraftModel", "LlamaTarget"}

# not public, importable from the package only because modules outside the files of this change
# import them from there (drafter/, model/, serving/, tests/, benchmarks/, scripts/, docs/)
COMPAT = {
    "pyggml_dkv": [
        "BackendUnavailableError",
        "BackendWeights",
        "CheckpointError",
        "CheckpointNotFoundError",
        "ConfigError",
        "DraftKvState",
        "WeightsError",
        "available_backends",
        "bf16_attention_supported",
        "draft_kv_begin_step",
        "draft_kv_free",
        "draft_kv_init",
        "draft_kv_reset",
        "list_devices",
        "live_objects",
    ],
    "pyggml_dkv.ggml": [
        "GGML_REPACK_TYPES",
        "TYPE_NAMES",
        "amx_available",
        "amx_fits",
        "bf16_attention_kernel",
        "bf16_attention_supported",
        "bf16_matmul_kernel",
        "bf16_products_on_fma",
        "built_backends",
        "built_capabilities",
        "cpu_extra_buffer_types",
        "cpu_features",
        "cpu_repack_fits",
        "cpu_repack_kernel",
        "cuda_graph_stats",
        "ffi",
        "ggml_repack_fits",
        "ggml_type",
        "half_matmul_avx2",
        "host_array",
        "lib",
        "vnni_available",
        "vnni_repack_fits",
    ],
    "pyggml_dkv.hosts.llama_cpp": ["SMOLLM2_LAYER_IDS"],
}


def has_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_all_is_the_documented_list(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    assert len(set(module.__all__)) == len(module.__all__)


def test_the_top_level_names_are_documented_in_the_package_docstring():
    import pyggml_dkv

    missing = [n for n in pyggml_dkv.__all__ if f"`{n}`" not in pyggml_dkv.__doc__]
    assert not missing, f"public names the docstring does not mention: {missing}"
    assert set(pyggml_dkv.__all__) <= set(dir(pyggml_dkv))


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        if name in NEEDS_LLAMA_CPP and not has_llama_cpp():
            continue
        assert getattr(module, name) is not None, name
    # `from package import *` gives exactly the public names
    namespace: dict = {}
    if package == "pyggml_dkv.hosts.llama_cpp" and not has_llama_cpp():
        pytest.skip("some public names need llama-cpp-python")
    exec(f"from {package} import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(module.__all__)


@pytest.mark.parametrize("package", sorted(COMPAT))
def test_kept_names_resolve_but_are_not_public(package):
    module = importlib.import_module(package)
    for name in COMPAT[package]:
        assert name not in module.__all__, name
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_no_raw_cffi_objects_probes_or_patch_constants_are_public(package):
    names = importlib.import_module(package).__all__
    assert not {"ffi", "lib"} & set(names)
    assert not [n for n in names if "patch" in n.lower() or n.startswith("_")]
    assert not [n for n in names if n.endswith(("_available", "_fits", "_kernel", "_supported"))], names


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize(
    "statement",
    [
        "import pyggml_dkv",
        "from pyggml_dkv import DraftConfig, DraftWeights",
        "from pyggml_dkv.llama import speculative_llama",
        "import pyggml_dkv.hosts.llama_cpp",
    ],
)
def test_importing_the_package_is_cheap(statement):
    """Neither llama.cpp nor PyTorch, nor our compiled ggml, load until a name that needs them is used."""
    heavy = ("llama_cpp", "torch", "pyggml_dkv._ggml_cffi", "pyggml_dkv.ggml", "pyggml_dkv.drafter")
    out = run_python(f"import sys\n{statement}\nprint(sorted(m for m in {heavy!r} if m in sys.modules))")
    assert out == "[]", f"{statement} imported {out}"


def test_a_lazy_name_loads_its_module_on_first_use():
    out = run_python(
        "import sys, pyggml_dkv\nassert 'pyggml_dkv.drafter.drafter' not in sys.modules\n"
        "pyggml_dkv.Drafter\nprint('pyggml_dkv.drafter.drafter' in sys.modules, 'llama_cpp' in sys.modules)"
    )
    assert out == "True False"


def test_an_unknown_name_is_an_attribute_error():
    import pyggml_dkv
    import pyggml_dkv.hosts.llama_cpp as host

    with pytest.raises(AttributeError, match="no attribute 'AMX_PATCH'"):
        pyggml_dkv.AMX_PATCH  # noqa: B018
    with pytest.raises(ImportError):
        exec("from pyggml_dkv import lib", {})
    with pytest.raises(AttributeError):
        host.accept_greedy  # noqa: B018  # in its module (acceptance), not the package


def imported_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from pyggml_dkv... import name` in a file, and `import pyggml_dkv...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyggml_dkv") and not node.level:
            found.extend((node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((a.name, "") for a in node.names if a.name.startswith("pyggml_dkv"))
    return found


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_import_public_names_only(example):
    wrong = [
        f"{module}: {name}"
        for module, name in imported_names(example)
        if module not in PUBLIC or (name and name not in PUBLIC[module])
    ]
    assert not wrong, f"{example.name} imports names that are not public: {wrong}"


def test_the_quickstart_example_is_short():
    """speculative_llama's promise: llama-cpp-python with the drafter in about ten lines."""
    source = (ROOT / "examples" / "llama_cpp_quickstart.py").read_text()
    first = ast.parse(source).body[1].lineno  # after the docstring
    code = [line for line in source.splitlines()[first - 1 :] if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 10, code
