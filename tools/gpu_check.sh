#!/usr/bin/env bash
# One prepared pass of the CUDA/NCCL code paths on a single-GPU machine (docs/benchmarks.md,
# "On one H100"). Run from the repository root; OUT (a folder) receives the logs. Python
# packages the machine lacks travel as wheels in .whl/ (pyzmq, cryptography, cffi, pycparser).
set -u
OUT=${OUT:-/tmp/gpu_check}; LOGS=$(mktemp -d); mkdir -p "$OUT"; trap 'tar czf "$OUT/logs.tgz" -C "$LOGS" .' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DISTTRAIN_TIMEOUT=30
DT="python3 -m disttrain"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1; local rc=$?
  echo "--- rc $rc, $((SECONDS - t0)) s"; grep -E "step +[0-9]+ |loss .* -> |Error|error" "$LOGS/$name.log" | tail -n 8; }

nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.nccl.version())"
# the device table's H100 efficiencies (devices.json): bf16 matmul 80.3% of 989 TFLOP/s, copies 75% of 3.35 TB/s
python3 - <<'PY'
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(20): a @ b
e.record(); torch.cuda.synchronize(); t = s.elapsed_time(e) / 1e3 / 20
print(f"bf16 8192^3 matmul: {2 * 8192**3 / t / 1e12:.0f} TFLOP/s = {2 * 8192**3 / t / 989e12:.1%} of 989")
x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize(); t = s.elapsed_time(e) / 1e3 / 20
print(f"device copy: {2 * x.numel() / t / 1e12:.2f} TB/s read+written = {2 * x.numel() / t / 3.35e12:.1%} of 3.35")
PY
G="examples/gpt_char.py --sample-chars 1 --log-every 10"
step dp1_fp32 90 $DT run --nproc 1 $G --steps 20
step zero1_bf16 90 $DT run --nproc 1 $G --steps 20 --zero 1 --precision bf16
step zero3_bf16 90 $DT run --nproc 1 $G --steps 20 --zero 3 --precision bf16
step zero2_fp16 90 $DT run --nproc 1 $G --steps 20 --zero 2 --precision fp16
step digits_dp 90 $DT run --nproc 1 examples/digits.py --epochs 2
step two_ranks_one_gpu 90 $DT run --nproc 2 $G --steps 5 --dp 2
# the planner against a measured step: GPT, bf16 with fp32 master weights (ZeRO-1 at 1 rank)
M1="--n-layer 12 --n-embd 768 --n-head 12 --block-size 1024 --batch-size 8"
step gpt_124m 150 $DT run --nproc 1 $G --steps 40 --zero 1 --precision bf16 $M1
$DT plan layout --model gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=128 --devices 1 \
  --device h100 --global-batch 8 --micro-batch 8 --explain >"$LOGS/plan_124m.txt" 2>&1; head -n 3 "$LOGS/plan_124m.txt"
M2="--n-layer 16 --n-embd 2048 --n-head 16 --block-size 1024 --batch-size 8"
step gpt_830m 150 $DT run --nproc 1 $G --steps 40 --zero 1 --precision bf16 $M2
$DT plan layout --model gpt:layers=16,hidden=2048,heads=16,seq=1024,vocab=128 --devices 1 \
  --device h100 --global-batch 8 --micro-batch 8 --explain >"$LOGS/plan_830m.txt" 2>&1; head -n 3 "$LOGS/plan_830m.txt"
