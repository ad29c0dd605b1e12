#!/usr/bin/env bash
# One-GPU run of benchmarks/ddp_distill.py (issue 8), as sent to the nvidia-h200 device box:
#   bash benchmarks/ddp_gpu_one.sh        (from the repo root; results under $OUT)
# 1. installs the carried wheels (.whl_ddp/: zarr, numcodecs, pydantic, ...) into /tmp/site and
#    maps the repo's folders into the logitcache namespace through symlinks in /tmp/ns;
# 2. NCCL smoke: a world-1 NCCL process group, all_reduce and a DDP backward (ddp_distill.py
#    creates no process group when it runs one process, so its own run does not touch NCCL);
# 3. writes the synthetic cache through the format library (ddp_gpu_cache.py);
# 4. trains one epoch on one GPU (ddp_distill.py train, bf16, checkpoint at step $AT);
# 5. resumes from that checkpoint in a fresh process and runs to the end of the epoch;
# 6. summarises (ddp_gpu_summary.py) into $OUT/ddp_gpu.json.
# With SWEEP="12 15" (DataLoader worker counts) steps 4-6 are replaced by short runs of $STEPS
# steps, one per worker count, each summarised as throughput + data-wait share
# ($OUT/workers<N>.json, ddp_distill.throughput).
# Every size is an environment variable (defaults: the GPU run) so the same lines run on CPU.
set -uo pipefail
OUT=${OUT:-/tmp/ddp_out}; W=${W:-/tmp/ddp}; PY=${PY:-python3}
NSEQ=${NSEQ:-20480}; LEN=${LEN:-1025}; VOCAB=${VOCAB:-128256}; K=${K:-100}; PROCS=${PROCS:-12}
TPI=${TPI:-1024}; BI=${BI:-8}; HID=${HID:-1024}; LAYERS=${LAYERS:-4}; HEADS=${HEADS:-8}
DTYPE=${DTYPE:-bfloat16}; BACKEND=${BACKEND:-nccl}; WORKERS=${WORKERS:-6}; AT=${AT:-2048}
WARMUP=${WARMUP:-20}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" "$W"
log() { echo "[$(date -u +%T)] $*"; }
if [ -z "${SKIP_INSTALL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl_ddp/*.whl || exit 1
  mkdir -p /tmp/ns/logitcache
  for p in cache_format client server fixtures; do ln -sfn "$PWD/$p" "/tmp/ns/logitcache/$p"; done
  export PYTHONPATH=/tmp/ns:/tmp/site
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc; $PY -c 'import torch, zarr, numcodecs, pydantic, numpy; print(torch.__version__, zarr.__version__, numcodecs.__version__, pydantic.__version__, numpy.__version__)'
fi
log "nccl smoke"
$PY - "$BACKEND" <<'PY' || exit 1
import os, sys, torch, torch.distributed as dist
backend = sys.argv[1]
dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
dist.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
x = torch.full((4,), 3.0, device=dev); dist.all_reduce(x)
m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).to(dev))
m(torch.ones(2, 8, device=dev)).sum().backward()
objs = [None]; dist.all_gather_object(objs, {"ok": 1})
print("smoke", backend, x.tolist(), float(m.module.weight.grad.abs().sum()), objs,
      {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")})
dist.destroy_process_group()
PY
log "cache"
timeout 240 $PY benchmarks/ddp_gpu_cache.py --url "$W/cache" --vocab "$VOCAB" --k "$K" \
  --num-sequences "$NSEQ" --min-len "$LEN" --max-len "$LEN" --procs "$PROCS" \
  --json "$OUT/cache.json" 2>&1 | grep -v '^\[cache\]' || exit 1
du -sh "$W/cache"
TRAIN=(--cache "$W/cache" --nproc 1 --backend "$BACKEND" --tokens-per-item "$TPI"
  --batch-items "$BI" --hidden "$HID" --layers "$LAYERS" --heads "$HEADS" --dtype "$DTYPE"
  --workers "$WORKERS")
if [ -n "${SWEEP:-}" ]; then
  for nw in $SWEEP; do
    log "train $STEPS steps, workers $nw"
    timeout 100 $PY benchmarks/ddp_distill.py train "${TRAIN[@]}" --workers "$nw" \
      --steps "$STEPS" --out "$OUT/workers$nw.json" || exit 1
    $PY -c "import json,sys; sys.path.insert(0,'benchmarks'); import ddp_distill as d; \
r=json.load(open('$OUT/workers$nw.json')); print('workers $nw', json.dumps(d.throughput(r, $WARMUP)), \
r['ranks'][0]['memory'])"
  done
  log "done"; exit 0
fi
log "train (one epoch, checkpoint at $AT)"
timeout 250 $PY benchmarks/ddp_distill.py train "${TRAIN[@]}" --out "$OUT/full.json" \
  --checkpoint-at "$AT" --checkpoint-dir "$W/ckpt" || exit 1
log "resume from step $AT"
timeout 100 $PY benchmarks/ddp_distill.py train "${TRAIN[@]}" --out "$OUT/resumed.json" \
  --resume "$W/ckpt" || exit 1
log "summary"
$PY benchmarks/ddp_gpu_summary.py --full "$OUT/full.json" --resumed "$OUT/resumed.json" \
  --cache-json "$OUT/cache.json" --warmup "$WARMUP" --json "$OUT/ddp_gpu.json"
log "done"
