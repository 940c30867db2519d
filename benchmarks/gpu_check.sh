#!/usr/bin/env bash
# dtrain's CUDA and nccl paths on a real GPU, in one go: at most about 8 minutes on one GPU.
#
#     bash benchmarks/gpu_check.sh            # run from anywhere; prints a Markdown table at the end
#
# What the CPU suite cannot show: the main job over nccl (world size 1) in fp32/TF32, bf16 and fp16
# (GradScaler's skipped steps counted, norms finite), MFU against the GPU's peak, a 2-process job on
# the same GPU over gloo (DDP with CUDA tensors) whose launcher holds no CUDA context, exact resume on
# the GPU (dropout: the CUDA RNG state) with the optimizer's step where torch keeps it, the W1
# throughput benchmark, a forced hang (the flight recorder dumped into diagnostics/) and a real
# out-of-memory (the one-line advice). Each check is one row; the script exits 1 if any row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-gpu-check.XXXXXX")
export PYTHONPATH="$ROOT/src:$ROOT/tests/workers${PYTHONPATH:+:$PYTHONPATH}"
export DTRAIN_GPU_CHECK_WORK=$WORK
ROWS=()
FAILED=0

row() {  # row NAME ok|FAIL|info DETAIL
    ROWS+=("| $1 | $2 | $3 |")
    [ "$2" = FAIL ] && FAILED=1
    printf '%-44s %-5s %s\n' "$1" "$2" "$3" >&2
}

dtrain() { timeout "${LIMIT:-120}" "$PY" -m dtrain "$@"; }

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: this needs torch with a visible CUDA GPU (python: $PY)" >&2
    exit 2
fi
if ! "$PY" -c 'import dtrain.trainer' 2>/dev/null; then
    "$PY" -m pip install -q -e "$ROOT" >&2 || { echo "gpu_check: cannot import or install dtrain" >&2; exit 2; }
fi
GPU=$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")')
row "GPU" info "$GPU"

JOB=(examples/digits_mlp.toml training.epochs=5 training.log_every=5)
metric() {  # metric RUN_DIR EXPRESSION-over-lines: evaluate over metrics.jsonl
    "$PY" - "$1" "$2" <<'EOF'
import json, math, sys
lines = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
train = [m for m in lines if "loss" in m]
evals = [m for m in lines if "eval_loss" in m]
print(eval(sys.argv[2]))
EOF
}

# 1. The main job over nccl at world size 1, in each precision.
for precision in fp32 bf16 fp16; do
    dir=$WORK/main-$precision
    if dtrain run "${JOB[@]}" --nproc 1 distributed.backend=nccl training.precision=$precision \
            training.max_grad_norm=1.0 run.dir="$dir" >"$dir.log" 2>&1; then
        acc=$(metric "$dir" '"{:.3f}".format(evals[-1]["eval_accuracy"])')
        mfu=$(metric "$dir" '"{:.2%}".format(train[-1].get("mfu", float("nan")))')
        extra=""
        if [ $precision = fp16 ]; then
            extra=$(metric "$dir" '", {} steps skipped".format(sum(m["skipped_steps"] for m in train))')
        fi
        good=$(metric "$dir" 'evals[-1]["eval_accuracy"] > 0.9 and all(math.isfinite(m.get("grad_norm", 0)) for m in train)')
        row "main job, nccl, $precision" "$([ "$good" = True ] && echo ok || echo FAIL)" "eval accuracy $acc, MFU $mfu$extra"
    else
        row "main job, nccl, $precision" FAIL "$(tail -n 1 "$dir.log")"
    fi
done

# 2. fp32 matmuls run in TF32 unless training.tf32=false; MFU is measured against that math.
tf32=$("$PY" - <<'EOF'
import torch
from dtrain.amp import precision_for
from dtrain import perf
device = torch.device("cuda", 0)
precision_for("fp32", device, tf32=True); on = torch.get_float32_matmul_precision()
precision_for("fp32", device, tf32=False); off = torch.get_float32_matmul_precision()
peak = perf.peak_tflops_of(torch.cuda.get_device_name(0), "fp32", True)
print(f"{on}/{off}, fp32 peak {peak} TFLOP/s" + ("" if on == "high" and off == "highest" else " WRONG"))
EOF
)
row "training.tf32 sets the matmul precision" "$([[ $tf32 == *WRONG* || -z $tf32 ]] && echo FAIL || echo ok)" "$tf32"

# 3. Two processes on the one GPU over gloo (DDP with CUDA tensors); the launcher holds no context.
dir=$WORK/gloo2
"$PY" -m dtrain run "${JOB[@]}" --nproc 2 distributed.backend=gloo run.dir="$dir" >"$dir.log" 2>&1 &
launcher=$!  # the launcher itself (torchrun's agent runs inside it)
holders=""
for _ in $(seq 60); do
    sleep 1
    kill -0 $launcher 2>/dev/null || break
    holders="$holders $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
done
wait $launcher; status=$?
if [ $status -eq 0 ]; then
    comm=$(metric "$dir" '"{:.2f}".format(train[-1]["comm_ms"])')
    acc=$(metric "$dir" '"{:.3f}".format(evals[-1]["eval_accuracy"])')
    row "2 processes, one GPU, gloo" ok "eval accuracy $acc, comm ${comm} ms/step (DDP's own sample)"
else
    row "2 processes, one GPU, gloo" FAIL "exit $status: $(tail -n 1 "$dir.log")"
fi
if [[ " $holders " == *" $launcher "* ]]; then
    row "launcher holds no CUDA context" FAIL "pid $launcher listed by nvidia-smi"
elif [ -n "${holders// /}" ]; then
    row "launcher holds no CUDA context" ok "nvidia-smi listed only workers:$(echo "$holders" | tr ' ' '\n' | sort -u | tr '\n' ' ')"
else
    row "launcher holds no CUDA context" info "nvidia-smi listed no process (cannot tell)"
fi

# 4. Exact resume on the GPU: dropout draws from the CUDA RNG; AdamW's step stays where torch keeps it.
resume=$(timeout 300 "$PY" - <<'EOF' 2>"$WORK/resume.log"
import os, torch
from pathlib import Path
from torch.utils.data import TensorDataset
import dtrain
from faults import dying_mlp

work = Path(os.environ["DTRAIN_GPU_CHECK_WORK"])
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 32, generator=g)
data = TensorDataset(x, (x[:, :3].argmax(1)))

def trainer(run, **training):
    torch.manual_seed(0)
    config = dtrain.Config.from_dict({"run": {"dir": str(work / run)}, "data": {"batch_size": 32},
                                      "optimizer": {"name": "adamw", "lr": 1e-3},
                                      "training": {"epochs": 2, "precision": "fp16", **training}})
    return dtrain.Trainer(config, model=dying_mlp((32,), 3, dropout=0.3), train_data=data)

whole = trainer("whole"); whole.fit()
trainer("split", stop_at_step=9).fit()
resumed = trainer("split"); resumed.fit()
same = all(torch.equal(a, b) for a, b in zip(whole.module.parameters(), resumed.module.parameters()))
where = lambda t: {s["step"].device.type for s in t.optimizer.state.values()}
print(f"bitwise {same}; fused {resumed.optimizer.defaults.get('fused')}; step on {where(resumed)} "
      f"(uninterrupted: {where(whole)})" + ("" if same and where(resumed) == where(whole) else " WRONG"))
EOF
)
row "resume on the GPU (fp16, dropout, AdamW)" "$([[ $resume == *WRONG* || -z $resume ]] && echo FAIL || echo ok)" "${resume:-$(tail -n 1 "$WORK/resume.log")}"

# 5. A forced hang: ended by the watchdog, the flight recorder dumped for every rank.
dir=$WORK/hang
LIMIT=120 dtrain run "${JOB[@]}" model.name=faults:dying_mlp "model.options={stall_at_forward = 5, stall_rank = 1}" \
    --nproc 2 distributed.backend=gloo distributed.hang_timeout_s=5 run.dir="$dir" >"$dir.log" 2>&1
status=$?
dumps=$(ls "$dir/diagnostics" 2>/dev/null | grep -c '^flight-recorder-rank-')
row "forced hang" "$([ $status -eq 124 ] && [ "$dumps" -ge 1 ] && echo ok || echo FAIL)" \
    "exit $status, $dumps flight-recorder dump(s): $(grep -o 'hang: [^;]*' "$dir.log" | head -n 1)"

# 6. A real out-of-memory: one line of advice, exit 2.
dir=$WORK/oom
dtrain run "${JOB[@]}" model.name=faults:dying_mlp "model.options={oom_at_forward = 3, oom_gib = 100000}" \
    --nproc 1 run.dir="$dir" >"$dir.log" 2>&1
status=$?
line=$(grep -c '^dtrain: error: out of GPU memory at step 3' "$dir.log")
row "forced out-of-memory" "$([ $status -eq 2 ] && [ "$line" -eq 1 ] && ! grep -q Traceback "$dir.log" && echo ok || echo FAIL)" \
    "exit $status: $(grep '^dtrain: error' "$dir.log" | cut -c1-140)"

# 7. W1 throughput (the guide's MLP, batch 64) on this GPU, one process per variant.
if table=$(timeout 240 "$PY" benchmarks/throughput.py --nproc 1 --rounds 1 --steps 300 2>"$WORK/throughput.log"); then
    row "W1 throughput, 1 GPU" ok "see the table below"
else
    row "W1 throughput, 1 GPU" FAIL "$(tail -n 1 "$WORK/throughput.log")"
fi

echo
echo "| check | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${ROWS[@]}"
[ -n "${table:-}" ] && printf '\nW1 on one GPU (benchmarks/throughput.py --nproc 1 --rounds 1 --steps 300):\n\n%s\n' "$table"
echo "(runs kept in $WORK)"
exit $FAILED
