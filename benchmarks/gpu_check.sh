#!/usr/bin/env bash
# dtrain's CUDA and nccl paths on a real GPU, in one go: at most about 8 minutes on one GPU.
#
#     bash benchmarks/gpu_check.sh            # run from anywhere; prints a Markdown table at the end
#     bash benchmarks/gpu_check.sh split gpt2 # only these checks (main inprocess gloo2 hang oom w1 gpt2 split)
#
# What the CPU suite cannot show: the main job with backend nccl (world size 1) in fp32/TF32, bf16 and
# fp16, MFU against the GPU's peak; TF32 really set; fp16 steps GradScaler skips (forced) counted and
# taken out of the schedule with fused AdamW and SGD; exact resume on the GPU (dropout: the CUDA RNG
# state) with the optimizer's step where torch keeps it; nccl's flight recorder dumped; a 2-process job
# on the same GPU over gloo (DDP with CUDA tensors) whose launcher holds no CUDA context; a forced hang
# (the flight recorder dumped into diagnostics/); a real out-of-memory (the one-line advice); the W1
# throughput benchmark; GPT-2 small in bf16 with torch.compile (tokens/s, MFU, peak memory); the model
# split over 2 processes (tensor, pipeline and context parallel) against one process, on 2 GPUs or
# sharing one. Each check is one row; the script exits 1 if any row failed. The in-process checks live
# in benchmarks/gpu_checks.py.
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
if ! "$PY" -c 'import dtrain.train.trainer' 2>/dev/null; then
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

# 1. The main job with backend nccl, in each precision (at world size 1 no group forms; the
#    nccl_flight_recorder row below runs a real nccl group).
check_main() {
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
}

# 2. In-process checks (benchmarks/gpu_checks.py): TF32, fp16 skipped steps forced (fused AdamW and
#    SGD), exact resume with dropout (fused and unfused AdamW), nccl's own flight recorder.
check_inprocess() {
    for check in tf32 fp16_skips resume nccl_flight_recorder; do
        line=$(timeout 300 "$PY" benchmarks/gpu_checks.py $check "$WORK/$check" 2>"$WORK/$check.log" | tail -n 1)
        detail=${line#* }
        row "$check" "$([[ $line == ok* ]] && echo ok || echo FAIL)" "${detail:-$(tail -n 1 "$WORK/$check.log")}"
    done
}

# 3. Two processes on the one GPU over gloo (DDP with CUDA tensors); the launcher holds no context.
check_gloo2() {
    dir=$WORK/gloo2
    timeout 300 "$PY" -m dtrain run "${JOB[@]}" --nproc 2 distributed.backend=gloo run.dir="$dir" >"$dir.log" 2>&1 &
    guard=$!
    sleep 2
    launcher=$(pgrep -P $guard | head -n 1)  # timeout's child: the launcher (torchrun's agent runs in it)
    seen=""
    workers=""
    for _ in $(seq 120); do
        kill -0 $guard 2>/dev/null || break
        seen="$seen $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
        [ -n "$launcher" ] && workers="$workers $(pgrep -P "$launcher" | tr '\n' ' ')"
        sleep 1
    done
    wait $guard; status=$?
    if [ $status -eq 0 ]; then
        comm=$(metric "$dir" '"{:.2f}".format(train[-1]["comm_ms"])')
        acc=$(metric "$dir" '"{:.3f}".format(evals[-1]["eval_accuracy"])')
        good=$(metric "$dir" 'evals[-1]["eval_accuracy"] > 0.9')
        row "2 processes, one GPU, gloo" "$([ "$good" = True ] && echo ok || echo FAIL)" \
            "eval accuracy $acc, comm ${comm} ms/step (DDP's own sample)"
    else
        row "2 processes, one GPU, gloo" FAIL "exit $status: $(tail -n 1 "$dir.log")"
    fi
    listed=$(echo "$seen" | tr ' ' '\n' | sort -u | grep . | tr '\n' ' ')
    matched=$(for pid in $workers; do [[ " $listed " == *" $pid "* ]] && echo "$pid"; done | sort -u | tr '\n' ' ')
    if [ -n "$launcher" ] && [[ " $listed " == *" $launcher "* ]]; then
        row "launcher holds no CUDA context" FAIL "launcher pid $launcher listed by nvidia-smi"
    elif [ -n "$matched" ]; then
        row "launcher holds no CUDA context" ok "nvidia-smi listed the workers ($matched) and not the launcher ($launcher)"
    else
        row "launcher holds no CUDA context" info "nvidia-smi's pids ($listed) are not this namespace's: cannot tell"
    fi
}

# 4. A forced hang (two processes on the GPU over gloo): ended by the watchdog with its one line,
#    the flight recorder dumped for both ranks. (nccl's recorder: the nccl_flight_recorder row.)
check_hang() {
    dir=$WORK/hang
    LIMIT=120 dtrain run "${JOB[@]}" model.name=faults:dying_mlp "model.options={stall_at_forward = 5, stall_rank = 1}" \
        --nproc 2 distributed.backend=gloo distributed.hang_timeout_s=5 run.dir="$dir" >"$dir.log" 2>&1
    status=$?
    dumps=$(ls "$dir/diagnostics" 2>/dev/null | grep -c '^flight-recorder-rank-')
    said=$(grep -c '^dtrain: error: hang: ' "$dir.log")
    row "forced hang" "$([ $status -eq 124 ] && [ "$said" -eq 1 ] && [ "$dumps" -eq 2 ] && echo ok || echo FAIL)" \
        "exit $status, $dumps flight-recorder dumps: $(grep -o 'hang: [^;]*' "$dir.log" | head -n 1)"
}

# 5. A real out-of-memory: one line of advice, exit 2.
check_oom() {
    dir=$WORK/oom
    dtrain run "${JOB[@]}" model.name=faults:dying_mlp "model.options={oom_at_forward = 3, oom_gib = 100000}" \
        --nproc 1 run.dir="$dir" >"$dir.log" 2>&1
    status=$?
    line=$(grep -c '^dtrain: error: out of GPU memory at step 3' "$dir.log")
    row "forced out-of-memory" "$([ $status -eq 2 ] && [ "$line" -eq 1 ] && ! grep -q Traceback "$dir.log" && echo ok || echo FAIL)" \
        "exit $status: $(grep '^dtrain: error' "$dir.log" | cut -c1-140)"
}

# 6. W1 throughput (the guide's MLP, batch 64) on this GPU, one process per variant.
check_w1() {
    if table=$(timeout 240 "$PY" benchmarks/throughput.py --nproc 1 --rounds 1 --steps 300 2>"$WORK/throughput.log"); then
        row "W1 throughput, 1 GPU" ok "see the table below"
    else
        row "W1 throughput, 1 GPU" FAIL "$(tail -n 1 "$WORK/throughput.log")"
    fi
}

# 7. GPT-2 small (12 layers, 12 heads, 768 wide, block 1024; the standard library's 4,096-token
#    vocabulary, not GPT-2's 50,257) in bf16 with torch.compile on this GPU: tokens/s, MFU, peak memory.
#    (FSDP needs several GPUs: on one, every strategy is the plain module.)
check_gpt2() {
    dir=$WORK/gpt2
    if timeout 240 "$PY" -m dtrain prepare text --python-stdlib --out "$WORK/stdlib" --workers 8 >"$dir.prep.log" 2>&1 &&
            LIMIT=300 dtrain run examples/gpt_stdlib.toml --nproc 1 data.path="$WORK/stdlib" data.block_size=1024 \
                data.batch_size=8 data.eval_batch_size=8 "model.options={n_layer = 12, n_head = 12, n_embd = 768, dropout = 0.0}" \
                training.precision=bf16 training.compile=blocks training.max_steps=60 training.log_every=20 \
                run.dir="$dir" >"$dir.log" 2>&1; then
        detail=$(metric "$dir" '"{:,.0f} tokens/s, MFU {:.1%}, peak {:.1f} GiB".format(train[-1]["tokens_per_s"], train[-1].get("mfu", float("nan")), max(train[0]["peak_bytes"]) / 2**30)')
        row "GPT-2 small, bf16, compile" ok "$detail; $(grep -o '^compiled.*' "$dir.log")"
    else
        row "GPT-2 small, bf16, compile" FAIL "$(tail -n 1 "$dir.log" 2>/dev/null || tail -n 1 "$dir.prep.log")"
    fi
}

# 8. The model split over 2 GPUs, each layout's per-step losses against one process on the same batches
#    (fp32, no dropout, accumulation 2 and clipping): tensor parallel (tp 2), pipeline parallel (pp 2,
#    1F1B) and context parallel (cp 2 under DDP and FSDP: each sequence split over both, attention as
#    torch's ring; dtrain's only run of it, torch has no CPU rule for ring attention). One process per GPU
#    over nccl: nccl takes one process per GPU, and two processes sharing one GPU over gloo do not get
#    far (seen on an H200 with torch 2.11: tp 2 and cp 2 killed by SIGSEGV in gloo's collectives on CUDA
#    tensors, pp 2 stopped by gloo's send and receive).
check_split() {
    local steps=${SPLIT_STEPS:-8}
    if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
        row "tensor, pipeline, context parallel" info "need 2+ GPUs: not run (context parallel stays untested here)"
        return
    fi
    local corpus=$WORK/json-corpus
    mkdir -p "$corpus" && cp -r "$("$PY" -c 'import json, os; print(os.path.dirname(json.__file__))')" "$corpus/json"
    timeout 120 "$PY" -m dtrain prepare text "$corpus" --out "$WORK/json-bytes" --tokenizer bytes --workers 1 \
        >"$WORK/split.prep.log" 2>&1 || { row "split model" FAIL "$(tail -n 1 "$WORK/split.prep.log")"; return; }
    SPLIT_JOB=(examples/gpt_stdlib.toml data.path="$WORK/json-bytes" data.block_size=256 data.batch_size=4
        "model.options={n_layer = 2, n_head = 4, n_embd = 128, dropout = 0.0}" training.precision=fp32
        training.max_steps=$steps training.log_every=1 training.eval_every=0 training.max_grad_norm=1.0
        training.grad_accum_steps=2 checkpoint.every_steps=0)
    LIMIT=180 dtrain run "${SPLIT_JOB[@]}" --nproc 1 run.dir="$WORK/split-one" >"$WORK/split-one.log" 2>&1
    local name settings
    for name in "tensor parallel, tp 2" "pipeline parallel, pp 2, 1f1b" "context parallel, cp 2, ddp" \
            "context parallel, cp 2, fsdp"; do
        case $name in
            tensor*) settings=(parallel.tp_size=2) ;;
            pipeline*) settings=(parallel.pp_size=2 parallel.pp_schedule=1f1b) ;;
            *ddp) settings=(parallel.cp_size=2) ;;
            *fsdp) settings=(parallel.cp_size=2 parallel.strategy=fsdp) ;;
        esac
        dir=$WORK/split-${name//[^a-z0-9]/}
        if [ -f "$WORK/split-one/metrics.jsonl" ] && LIMIT=180 dtrain run "${SPLIT_JOB[@]}" --nproc 2 \
                distributed.backend=nccl "${settings[@]}" run.dir="$dir" >"$dir.log" 2>&1; then
            worst=$(metric "$dir" "max(abs(a - b) / abs(b) for a, b in zip([m['loss'] for m in train], [json.loads(l)['loss'] for l in open('$WORK/split-one/metrics.jsonl') if '\"loss\"' in l]))")
            taken=$(metric "$dir" 'len(train)')
            good=$("$PY" -c "print($taken == $steps and $worst < 2e-3)")
            row "$name" "$([ "$good" = True ] && echo ok || echo FAIL)" \
                "$taken steps, per-step loss within $(printf '%.1e' "$worst") (relative) of one process"
        else
            said=$(grep -h '^dtrain: error' "$WORK/split-one.log" "$dir.log" 2>/dev/null | head -n 1)
            row "$name" FAIL "$(echo "${said:-$(tail -n 1 "$dir.log" 2>/dev/null)}" | cut -c1-200)"
        fi
    done
}

ALL=(main inprocess gloo2 hang oom w1 gpt2 split)
CHECKS=("$@")
[ ${#CHECKS[@]} -gt 0 ] || CHECKS=("${ALL[@]}")
for check in "${CHECKS[@]}"; do
    if [[ " ${ALL[*]} " != *" $check "* ]]; then
        echo "gpu_check: no check named '$check'; the checks are: ${ALL[*]}" >&2
        exit 2
    fi
done
for check in "${CHECKS[@]}"; do
    "check_$check"
done
echo
echo "| check | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${ROWS[@]}"
[ -n "${table:-}" ] && printf '\nW1 on one GPU (benchmarks/throughput.py --nproc 1 --rounds 1 --steps 300):\n\n%s\n' "$table"
echo "(runs kept in $WORK)"
exit $FAILED
