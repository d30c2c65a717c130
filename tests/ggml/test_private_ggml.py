"""ggml is private to the extension: nothing shipped exports or imports a ggml symbol, no shared
libggml is shipped, and the import-time stamp check refuses an extension that does not run the
recorded ggml build."""

from __future__ import annotations

import ctypes.util
import re
from pathlib import Path

import pytest
import tomllib

import pyggml_dkv
import pyggml_dkv.ggml
from pyggml_dkv._cffi import stamp as _stamp
from pyggml_dkv._cffi.stamp import BuildStamp, check_extension, expected_build, extension_build
from pyggml_dkv.ggml import _lowlevel
from tests.child import run_in_child
from tests.ggml.elf_dynsym import dynamic_symbols

pytestmark = pytest.mark.slow  # child interpreters with a second ggml: the slow tier

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent
PACKAGE = Path(pyggml_dkv.__file__).resolve().parent


def extension_path() -> Path:
    import pyggml_dkv._ggml_cffi as ext

    return Path(ext.__file__).resolve()


def shipped_shared_objects() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.so*") if p.is_file())


def mentions_ggml(name: str) -> bool:
    return "ggml" in name or "gguf" in name


def test_only_the_extension_is_a_shared_object():
    shipped = shipped_shared_objects()
    assert shipped == [extension_path()], f"shared objects in the package: {shipped}"
    assert not list((PACKAGE / "_libs").rglob("libggml*.so*"))


def test_extension_exports_only_its_init_and_imports_no_ggml():
    exported, undefined = dynamic_symbols(extension_path())
    assert exported == {"PyInit__ggml_cffi"}
    assert not [name for name in undefined if mentions_ggml(name)]


def test_symbol_reader_sees_exports_of_a_real_library():
    """The reader is not blind: libc exports malloc, and the extension needs it from outside."""
    libc = next(
        (
            line.split()[-1]
            for line in Path("/proc/self/maps").read_text().splitlines()
            if "/libc.so" in line or "/libc-" in line
        ),
        None,
    ) or ctypes.util.find_library("c")
    exported, _ = dynamic_symbols(Path(libc))
    assert {"malloc", "free"} <= exported
    _, undefined = dynamic_symbols(extension_path())
    assert "malloc" in undefined


def test_package_data_ships_no_ggml_library():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pyggml_dkv"]
    assert not [pattern for pattern in data if pattern.startswith("_libs/lib")]
    assert {"_libs/version", "_libs/variant", "_libs/build-id"} <= set(data)


def test_cpu_backend_is_registered_in_the_static_build():
    cpu = pyggml_dkv.available_backends()[0]
    assert cpu.name == "cpu" and cpu.available
    assert any(d["name"] == "CPU" and d["registry"] == "CPU" for d in pyggml_dkv.list_devices())


def test_extension_stamp_is_the_recorded_build_which_ggml_answers():
    ffi, lib = _lowlevel.ffi, _lowlevel.lib
    built = extension_build(ffi, lib)
    assert built == expected_build()
    assert built.variant == (PACKAGE / "_libs" / "variant").read_text().strip()
    assert re.fullmatch(r"pyggml_dkv-[0-9a-f]{16}", built.build_id)
    # the ggml answering the extension's calls is this build (llama.cpp's reports the same version)
    assert ffi.string(lib.ggml_commit()).decode() == built.build_id
    assert ffi.string(lib.ggml_version()).decode() == built.version
    pin = dict(
        line.split("=", 1)
        for line in (ROOT / "vendor" / "ggml.pin").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    if pyggml_dkv.ggml.built_capabilities():  # a pinned build (a GGML_SRC build carries nothing of ours)
        assert built.version == pin["GGML_VERSION"]


def test_capability_query_knows_every_name_the_build_recorded():
    """kernels.c lists each capability it can report under its macro: a name build_ggml.sh recorded
    for this build (from an applied patch) but kernels.c does not know would be lost silently."""
    ffi, lib = _lowlevel.ffi, _lowlevel.lib
    recorded = {name for name in ffi.string(lib.pyggml_dkv_build_capabilities()).decode().split(",") if name}
    reported = pyggml_dkv.ggml.built_capabilities()
    if "rpc" not in pyggml_dkv.ggml.built_backends():
        recorded.discard(pyggml_dkv.ggml.capabilities.RPC_ERRORS_FIX)  # reported only where the RPC backend was built
    assert reported == recorded
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name) for name in reported)


def run_child(function: str, *args: str, tmp_path: Path) -> str:
    out = tmp_path / "out.txt"
    proc = run_in_child(f"tests.ggml.private_ggml_cases:{function}", *args, str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


def other_version(built_version: str) -> str:
    """A ggml version that is not ours: llama-cpp-python's (0.25.3), or where we build that same
    release, the one we built before (0.10.1)."""
    return "0.10.1" if built_version == "0.25.3" else "0.25.3"


@pytest.mark.parametrize("change", ["version", "build"])
def test_stamp_mismatch_is_an_import_error_naming_both(change, tmp_path):
    built = extension_build(_lowlevel.ffi, _lowlevel.lib)
    version = other_version(built.version) if change == "version" else ""
    build_id = "pyggml_dkv-0123456789abcdef" if change == "build" else ""  # e.g. ggml rebuilt, extension not
    message = run_child("import_with_expected", version, build_id, tmp_path=tmp_path)
    assert message.startswith("ImportError: ")
    fake = BuildStamp(version or built.version, built.variant, build_id or built.build_id)
    assert str(built) in message and str(fake) in message


def test_unchanged_expectation_imports(tmp_path):
    assert run_child("import_with_expected", "", "", tmp_path=tmp_path) == "imported"


class _FakeFfi:
    @staticmethod
    def string(value: bytes) -> bytes:
        return value


class _ForeignGgml:
    """An extension whose stamp is ours but whose ggml calls reach another ggml (the old failure)."""

    def __init__(self, built: BuildStamp, running_commit: str) -> None:
        self.built, self.running_commit = built, running_commit

    def pyggml_dkv_built_ggml_version(self) -> bytes:
        return self.built.version.encode()

    def pyggml_dkv_built_variant(self) -> bytes:
        return self.built.variant.encode()

    def pyggml_dkv_built_ggml_build_id(self) -> bytes:
        return self.built.build_id.encode()

    def ggml_version(self) -> bytes:
        return self.built.version.encode()  # llama.cpp's ggml reports the same version as ours

    def ggml_commit(self) -> bytes:
        return self.running_commit.encode()


def test_another_ggml_answering_is_an_import_error():
    """The version cannot tell: llama.cpp's ggml (llama-cpp-python 0.3.36) is 0.25.3 too. The build
    id, which build_ggml.sh makes ggml's commit string, can."""
    built = expected_build()
    assert check_extension(_FakeFfi(), _ForeignGgml(built, built.build_id)) == built
    with pytest.raises(
        ImportError,
        match=rf"built with ggml build {re.escape(built.build_id)}, but the ggml answering "
        r"its calls is build 'b1-4f2c'",
    ):
        check_extension(_FakeFfi(), _ForeignGgml(built, "b1-4f2c"))


def test_missing_record_names_what_is_missing(tmp_path):
    stamp = _stamp.expected_build(tmp_path)
    assert stamp.version == stamp.build_id == "(not recorded)"
