#!/usr/bin/env bash
# Pack what `splitspec serve` needs beyond a GPU machine's image into .gpu-bundle/site.tar.xz, for a machine that
# has torch and transformers but neither Ray nor a package registry (the device machine of this project's sessions):
# Ray 2.60 slimmed (no Java jars, RLlib, Tune, Train, Data, LLM or dashboard web client; native code stripped),
# Serve's and splitspec's Python dependencies at the versions this checkout's .venv runs, and the default pair's
# tokenizer (scripts/gpu-serve-check.sh builds a random-weight pair around it there). The wheels are taken for
# PY_VERSION (default 3.12, the GPU image's Python) and x86-64 Linux. Refuses to leave a bundle that, with the
# working tree, would not fit the 64 MiB a device call carries. Needs pip's registry, strip and xz; ~2 minutes.
#   bash scripts/gpu-bundle.sh && run(command="bash scripts/gpu-serve-check.sh", carry=[".gpu-bundle"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
VENV_PY="${VENV_PY:-.venv/bin/python}"
BUNDLE="${BUNDLE:-.gpu-bundle}"
LIMIT=$((64 * 1024 * 1024))
# what the image lacks (KINDS.md's package list) or may hold at a version older than the checked-in stubs need
PACKAGES=(ray pydantic pydantic_core annotated-types typing-inspection fastapi starlette uvicorn jsonschema
          jsonschema-specifications referencing rpds-py grpcio grpcio-health-checking grpcio-reflection protobuf
          opentelemetry-api typing-extensions annotated-doc anyio)
TOKENIZER_FILES=(tokenizer.json tokenizer_config.json chat_template.jinja)

for tool in strip xz; do
  command -v "$tool" >/dev/null || { echo "error: $tool is missing (Debian: binutils, xz-utils)" >&2; exit 1; }
done
pins=()
for p in "${PACKAGES[@]}"; do
  pins+=("$p==$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
target_dir=$("$VENV_PY" -c "from services.models import default_pair; print(default_pair.target_dir())")
[ -f "$target_dir/tokenizer.json" ] || { echo "error: the default pair is not prepared ($target_dir): run splitspec models prepare" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
echo "installing for Python $PY_VERSION: ${pins[*]}"
"$VENV_PY" -m pip install -q --no-deps --no-compile --only-binary=:all: --implementation cp --python-version "$PY_VERSION" \
  "${platforms[@]}" --target "$stage/site" "${pins[@]}"
# Ray's parts a Serve app never imports; the dashboard's Python stays (the node agent runs it)
rm -rf "$stage"/site/ray/{jars,rllib,tune,train,data,llm,dashboard/client/build} "$stage"/site/bin
find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
find "$stage/site" -name RECORD -path '*.dist-info/*' -delete
# (strip leaves a file that is not ELF, e.g. an __init__.py beside the binaries, as it is)
find "$stage/site/ray" -type f \( -name '*.so' -o -path '*/core/src/ray/*' \) -exec sh -c \
  'strip --strip-unneeded "$1" 2>/dev/null || true' _ {} \;
mkdir "$stage/tokenizer"
for f in "${TOKENIZER_FILES[@]}"; do cp "$target_dir/$f" "$stage/tokenizer/"; done

echo "compressing $(du -sh "$stage" | cut -f1) ..."
tar -C "$stage" -cf - site tokenizer | xz -9 -T2 > "$stage/site.tar.xz"

# the working tree that travels: tracked files and untracked files git does not ignore (a deleted one counts 0),
# plus the bundle; an old bundle in $BUNDLE is replaced, not counted
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | { xargs -0 stat -c %s 2>/dev/null || true; } \
        | awk '{s+=$1} END {print s+0}')
bundle=$(stat -c %s "$stage/site.tar.xz")
total=$((tree + bundle))
echo "bundle: $((bundle / 1024)) KiB; with the working tree $((total / 1024)) KiB of the $((LIMIT / 1024)) KiB a device call carries"
if [ "$total" -gt "$LIMIT" ]; then
  echo "error: over the limit: the bundle would not travel (nothing written to $BUNDLE)" >&2
  exit 1
fi
mkdir -p "$BUNDLE"
mv "$stage/site.tar.xz" "$BUNDLE/site.tar.xz"
{ printf '%s\n' "${pins[@]}"; echo "python $PY_VERSION"; } > "$BUNDLE/versions.txt"
echo "wrote $BUNDLE/site.tar.xz"
