#!/bin/sh
# vLLM's `suffix` speculative method (SuffixDecoding), the anchor `reprise bench engine` measures as
# `vllm_suffix`, imports arctic-inference's suffix module (`arctic_inference.suffix_decoding`). PyPI has
# arctic-inference only as an sdist whose build wants torch 2.7 and CUDA for its other parts, so this
# builds just the suffix module from the pinned, hash-checked release sdist: its C++ core
# (csrc/suffix_decoding, nanobind, as the sdist pins) and its Python facade, installed into the venv as
# the distribution `arctic-inference` (version 0.1.1+suffix; `pip uninstall arctic-inference` removes it).
#
#   tools/install_arctic_suffix.sh PYTHON
set -eu
PY=${1:?usage: install_arctic_suffix.sh PYTHON}
VERSION=0.1.1
SHA256=36857e2fbe3ead34821a04be98dfab95086050c1e38199c8fdfe308234fdcf63
NANOBIND=2.9.2

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# --no-build-isolation: pip reads the sdist's metadata with the venv's own packages (isolated, its
# build requirements would pull a CUDA torch).
"$PY" -m pip download -q --no-deps --no-build-isolation --no-binary :all: "arctic-inference==$VERSION" -d "$work"
echo "$SHA256  $work/arctic_inference-$VERSION.tar.gz" | sha256sum -c --quiet
tar xzf "$work/arctic_inference-$VERSION.tar.gz" -C "$work"
src="$work/arctic_inference-$VERSION"
"$PY" -m pip install -q "nanobind==$NANOBIND"
cmake -S "$src/csrc/suffix_decoding" -B "$work/build" -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" -j 2 >/dev/null

pkg="$work/pkg"
mkdir -p "$pkg/arctic_inference/suffix_decoding"
: > "$pkg/arctic_inference/__init__.py"
cp "$src"/arctic_inference/suffix_decoding/__init__.py "$src"/arctic_inference/suffix_decoding/cache.py \
  "$src"/arctic_inference/suffix_decoding/simulator.py "$src/LICENSE" "$pkg/arctic_inference/suffix_decoding/"
cp "$work"/build/_C*.so "$pkg/arctic_inference/suffix_decoding/"
cat > "$pkg/pyproject.toml" <<TOML
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "arctic-inference"
version = "$VERSION+suffix"
description = "arctic-inference's suffix decoding module only (SuffixDecoding), built from the $VERSION sdist"
license = "Apache-2.0"
dependencies = ["numpy"]

[tool.setuptools]
packages = ["arctic_inference", "arctic_inference.suffix_decoding"]

[tool.setuptools.package-data]
"arctic_inference.suffix_decoding" = ["_C*.so", "LICENSE"]
TOML
"$PY" -m pip install -q --no-deps --no-build-isolation "$pkg"
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(max_tree_depth=24, max_cached_requests=8); print('arctic-inference suffix module $VERSION')"
