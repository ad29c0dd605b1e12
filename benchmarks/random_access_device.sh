#!/usr/bin/env bash
# benchmarks/random_access_device.sh OUTDIR [random_access_bench.py options...]
#
# benchmarks/random_access_bench.py (+ format_bench's default vs random-access configs and the
# random-access tests) on a box where the project is not installed (the device H200 box): the
# wheels carried in .whl (zarr, numcodecs, google-crc32c, pydantic, ...) go to /tmp/site, the
# logitcache namespace is made of symlinks to the repository's folders.
#
# RA_SKIP_TESTS=1: without the random-access tests. RA_SKIP_FORMAT=1: without the format bench. (--processes N...: CacheReader(read_processes=N)
#   figures, for trees that have it; tests/test_procread.py runs with the random-access tests.)
# RA_OLD=DIR: before/after in one call: DIR holds older versions of some cache_format/*.py files
#   (e.g. `git show 36bd27e:cache_format/pointread.py`); after the run of this tree's code, the
#   bench runs again on the same stores (--reuse) with those files in place of the tree's
#   (everything else as in the tree), and then once more with the tree's code, so the two are
#   measured alternately on one machine. Extra options for those runs: RA_OLD_ARGS.
# RA_NOFAST=1: after those, the tree once more with LOGITCACHE_FASTDECODE=0 (the per-chunk path of
#   the same code: compiled decode off), on the same stores.
# RA_STAGES=1: then benchmarks/random_access_stages.py --codecs on the stores (stage by stage CPU
#   of one sequence(i), the codec's floor, cheaper codecs' bytes and decode time).
set -uo pipefail
out="$1"
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
mkdir -p /tmp/lcpkg/logitcache "$out"
for d in cache_format client server fixtures protocol; do ln -sfn "$PWD/$d" "/tmp/lcpkg/logitcache/$d"; done
export PYTHONPATH="/tmp/site:/tmp/lcpkg:$PWD/tests" PYTHONUNBUFFERED=1
{ nproc; uptime; lscpu | grep -E "Model name|^CPU\(s\)"; } 2>&1 | tee "$out/machine.txt"
[ -n "${RA_SKIP_TESTS:-}" ] || python3 -m pytest -q -n 0 -p no:cacheprovider -o addopts="" tests/test_format_random_access.py \
    tests/test_format_golden.py tests/test_procread.py tests/test_fastdecode.py -k "not s3" 2>&1 | tail -5 | tee "$out/tests.txt"
python3 benchmarks/random_access_bench.py --json "$out/client_random.json" --label tree "$@" 2>&1 \
    | grep -v '^ \|^[{}]' | tee "$out/client_random_log.txt"
if [ -n "${RA_OLD:-}" ]; then
    mkdir -p /tmp/lcold/logitcache
    cp -r cache_format /tmp/lcold/logitcache/
    cp "$RA_OLD"/*.py /tmp/lcold/logitcache/cache_format/
    for d in client server fixtures protocol; do ln -sfn "$PWD/$d" "/tmp/lcold/logitcache/$d"; done
    # shellcheck disable=SC2086
    PYTHONPATH="/tmp/site:/tmp/lcold:$PWD/tests" python3 benchmarks/random_access_bench.py \
        --json "$out/client_random_old.json" --label old "$@" --reuse ${RA_OLD_ARGS:-} 2>&1 \
        | grep -v '^ \|^[{}]' | tee -a "$out/client_random_log.txt"
    # shellcheck disable=SC2086
    python3 benchmarks/random_access_bench.py --json "$out/client_random_again.json" \
        --label tree-again "$@" --reuse ${RA_OLD_ARGS:-} 2>&1 \
        | grep -v '^ \|^[{}]' | tee -a "$out/client_random_log.txt"
fi
if [ -n "${RA_NOFAST:-}" ]; then
    # shellcheck disable=SC2086
    LOGITCACHE_FASTDECODE=0 python3 benchmarks/random_access_bench.py \
        --json "$out/client_random_nofast.json" --label tree-nofast "$@" --reuse ${RA_OLD_ARGS:-} \
        2>&1 | grep -v '^ \|^[{}]' | tee -a "$out/client_random_log.txt"
fi
if [ -n "${RA_STAGES:-}" ]; then
    root=$(python3 -c 'import sys; a = sys.argv[1:]; print(a[a.index("--root") + 1])' "$@")
    python3 benchmarks/random_access_stages.py --root "$root" --codecs --reads 200 \
        --json "$out/client_random_stages.json" 2>&1 | tail -3 | cut -c1-600
fi
[ -n "${RA_SKIP_FORMAT:-}" ] || python3 benchmarks/format_bench.py --rows 262144 --configs default,random-access --cores 1 \
    --random-reads 128 --out "$out/format_random.json" --md "$out/format_random.md" 2>&1 | tail -3
