#!/usr/bin/env bash
# The GPU check (issue 24, item 4): on a machine with one or more NVIDIA GPUs, in under ~5 min,
#   1. the CUDA tests (tests/gpu/: one NCCL rank per visible GPU); none may be skipped;
#   2. on one GPU, a ~1B-parameter GPT (bf16 compute, fp32 master): the bare model,
#      fullshard at world size 1 and FSDP2 at world size 1 -- tokens/s and peak memory, i.e.
#      the engine's per-step overhead with nothing to communicate;
#   3. with >= 2 GPUs, fullshard FULL_SHARD and FSDP2 on all of them: step time and MFU;
# then prints one table (benchmarks/gpu_check.py table) and exits non-zero if anything failed.
#
#   benchmarks/gpu_check.sh                 # on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --dry-run       # anywhere: the same steps on CPU, tiny model, gloo
#
# Environment: PYTHON (default: .venv/bin/python if present, else python), GPU_PEAK_TFLOPS
# (the dense bf16 peak per GPU, when the device name is not in gpu_check.py's list),
# GPU_CHECK_STEPS (default 8), GPU_CHECK_MICRO_BATCH (default 4), GPU_CHECK_OUT (a directory
# for the JSON lines; default a temporary one).
set -u -o pipefail

cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DRY=""
case "${1:-}" in
  --dry-run) DRY="--dry-run" ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
STEPS=${GPU_CHECK_STEPS:-8}
MB=${GPU_CHECK_MICRO_BATCH:-4}
OUT=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
failures=()
fail() { failures+=("$1"); echo "gpu_check: FAILED: $1" >&2; }
started=$SECONDS

if [[ -z "$DRY" ]]; then
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') || NGPU=0
  if [[ "$NGPU" -lt 1 ]]; then
    echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False);" \
         "run with --dry-run to exercise the script on CPU" >&2
    exit 1
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
else
  NGPU=2   # the dry run takes the multi-GPU path with 2 gloo ranks on CPU
fi
echo "gpu_check: $NGPU device(s)${DRY:+ (dry run on CPU)}, records in $RESULTS"

# 1. the CUDA tests
if [[ -z "$DRY" ]]; then
  echo "== 1/3 tests/gpu ($NGPU NCCL rank(s))"
  log="$OUT/pytest.log"
  timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then fail "tests/gpu (exit $rc)"
  elif grep -qiE '[0-9]+ skipped' "$log"; then fail "tests/gpu skipped tests on a GPU machine"; fi
else
  echo "== 1/3 tests/gpu: not run in a dry run (they need CUDA)"
fi

# 2. one GPU: bare model, fullshard world size 1, FSDP2 world size 1
echo "== 2/3 one device: bare / fullshard / FSDP2"
one_device=(env CUDA_VISIBLE_DEVICES=0)
[[ -n "$DRY" ]] && one_device=(env)
for v in bare fullshard fsdp2; do
  "${one_device[@]}" timeout 150 "$PY" benchmarks/gpu_check.py run --variant "$v" \
      --steps "$STEPS" --micro-batch "$MB" --out "$RESULTS" $DRY > "$OUT/ws1-$v.log" 2>&1 \
    || { tail -n 20 "$OUT/ws1-$v.log" >&2; fail "one device, $v"; }
done

# 3. all GPUs: fullshard FULL_SHARD vs FSDP2
if [[ "$NGPU" -ge 2 ]]; then
  echo "== 3/3 $NGPU devices: fullshard / FSDP2"
  for v in fullshard fsdp2; do
    timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
        benchmarks/gpu_check.py run --variant "$v" --steps "$STEPS" --micro-batch "$MB" \
        --out "$RESULTS" $DRY > "$OUT/ws$NGPU-$v.log" 2>&1 \
      || { tail -n 20 "$OUT/ws$NGPU-$v.log" >&2; fail "$NGPU devices, $v"; }
  done
else
  echo "== 3/3 skipped: one GPU (step time and MFU against FSDP2 need >= 2)"
fi

world=1; [[ "$NGPU" -ge 2 ]] && world=$NGPU
"$PY" benchmarks/gpu_check.py table "$RESULTS" --world "$world" || fail "table: a record is missing or NaN"
echo "gpu_check: $((SECONDS - started)) s"
if [[ ${#failures[@]} -gt 0 ]]; then
  printf 'gpu_check: %d failure(s):\n' "${#failures[@]}" >&2
  printf '  - %s\n' "${failures[@]}" >&2
  exit 1
fi
echo "gpu_check: all passed"
