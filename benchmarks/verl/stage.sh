#!/usr/bin/env bash
# Stage verl 0.9.1's own site directory for the GPU machine, as ../../../shared/gpu/stage.sh stages the kit: parts of
# at most 58 MB under .gpu/verl-stage/ (ignored by git), each sent in a call of its own, then install.sh.
# Run from the project's root:  bash benchmarks/verl/stage.sh [GROUP ...]   (groups in wheels.txt; default: verl)
# The kit itself (ray, vllm, datasets, ...) is staged first with ../shared/gpu/stage.sh; verl's process puts this
# site directory ahead of the kit's, so its transformers 5.9 shadows the image's 5.17 for verl alone.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
cache=.gpu/verl-wheels stage=.gpu/verl-stage
mkdir -p "$cache"
rm -rf "$stage" && mkdir -p "$stage"

want=("${@:-verl}")
reqs=$(awk -v sel="${want[*]}" '
  /^# group:/ { g=$3; next } /^#/ || NF==0 { next }
  index(" " sel " ", " " g " ") { print $1 }' "$here/wheels.txt")
[ -n "$reqs" ] || { echo "stage.sh: no group matched: ${want[*]}" >&2; exit 2; }

plat=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform linux_x86_64 --platform any)
binary="" sdist=""
for r in $reqs; do
  case "$r" in antlr4-python3-runtime==*) sdist="$sdist $r" ;; *) binary="$binary $r" ;; esac
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${plat[@]}" -d "$cache" $binary
if [ -n "$sdist" ]; then  # pure Python, published as an sdist only: build its wheel here
  # shellcheck disable=SC2086
  python3 -m pip wheel -q --no-deps -w "$cache" $sdist
fi

bundle=$(mktemp -d)
mkdir -p "$bundle/wheels"
for r in $reqs; do
  name=${r%%==*} ver=${r#*==}
  norm=$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')
  f=$(ls "$cache" | awk -v n="$norm" -v v="$ver" 'BEGIN{IGNORECASE=1} { s=$0; gsub("-","_",s) } index(tolower(s), n "_" v "_")==1 || index(tolower(s), n "_" v ".")==1 {print; exit}')
  [ -n "$f" ] || { echo "stage.sh: no wheel for $r in $cache" >&2; exit 1; }
  cp "$cache/$f" "$bundle/wheels/"
done
tar -C "$bundle" -cf - . | split -b 58M -d -a 1 - "$stage/v"
rm -rf "$bundle"
cp "$here/install.sh" "$stage/install.sh"

n=$(ls "$stage"/v* | wc -l)
echo "staged $(du -sh "$stage" | cut -f1) in $n parts under $stage"
echo "After the kit (../shared/gpu/README.md), send these one after another, each call with only the file in brackets:"
for p in "$stage"/v*; do
  echo "  mkdir -p /tmp/gpu && cp $p /tmp/gpu/      [$p]"
done
echo "  source .gpu/stage/install.sh && source $stage/install.sh && python benchmarks/grpo_gpu.py --only verl   [$stage/install.sh]"
