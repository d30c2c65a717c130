#!/usr/bin/env bash
# Build the API reference from the docstrings with pdoc (the `docs` extra) into build/docs
# (git-ignored), and fail on any warning pdoc gives.
#
#   pip install -e ".[docs]" && bash scripts/build_docs.sh      # then open build/docs/index.html
#   bash scripts/build_docs.sh OUT_DIR                            # somewhere else
#
# Documented: the package top (`pyggml_dkv`, its public names only) and the public packages
# pyggml_dkv.hosts.llama_cpp, .serve, .model, .drafter and .reference, each with the submodules
# it makes public (a package's __all__ decides). The modules are imported, so the compiled
# extension must be built, and the llama.cpp host and the server need their extras (`llama`,
# `server`), as in CI.
#
# Every warning raised while pdoc imports and renders counts (an annotation it cannot resolve, a
# module it cannot import, a name in __all__ that does not exist, ...), except deprecation
# warnings that third-party packages raise about themselves on import: those are printed and
# not counted. The exit status is 1 when any counted warning was raised.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/docs}"
PYTHON="${PYTHON:-python}"

"$PYTHON" - "$OUT" <<'EOF'
import pathlib
import shutil
import sys
import warnings

try:
    import pdoc
    import pdoc.render
except ImportError:
    sys.exit('build_docs.sh: pdoc is not installed: pip install -e ".[docs]"')

out = pathlib.Path(sys.argv[1])
SPECS = [
    "pyggml_dkv", r"!pyggml_dkv\..*",  # the package top alone: its submodules are documented below or private
    "pyggml_dkv.hosts.llama_cpp",
    "pyggml_dkv.serve",
    "pyggml_dkv.model",
    "pyggml_dkv.drafter",
    "pyggml_dkv.reference",
]
PDOC = str(pathlib.Path(pdoc.__file__).parent)
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def counts(w: warnings.WarningMessage) -> bool:
    """Every warning counts but a deprecation notice raised from a third-party package's own file."""
    where = str(w.filename)
    third_party = ("site-packages" in where or "dist-packages" in where) and not where.startswith(PDOC)
    return not (issubclass(w.category, DEPRECATIONS) and third_party)


shutil.rmtree(out, ignore_errors=True)
pdoc.render.configure(docformat="markdown", show_source=False, search=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pdoc.pdoc(*SPECS, output_directory=out)

counted = [w for w in caught if counts(w)]
for w in caught:
    tag = "warning" if w in counted else "note (not counted)"
    print(f"build_docs.sh: {tag}: {w.filename}:{w.lineno}: {w.category.__name__}: {w.message}", file=sys.stderr)
pages = sorted(p.relative_to(out) for p in out.rglob("*.html"))
print(f"build_docs.sh: {len(pages)} pages in {out}, {len(counted)} warning(s)"
      + (f", {len(caught) - len(counted)} third-party deprecation note(s) not counted" if len(caught) > len(counted) else ""))
sys.exit(1 if counted else 0)
EOF
