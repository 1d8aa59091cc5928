#!/usr/bin/env bash
# The GPU checklist of DEVELOPERS.md ("When a GPU machine is lent") as one script, for the device machine whose
# time is short: every step under its own time limit, one log, one line per step in steps.txt.
#
#   bash benchmarks/gpu_checklist.sh [run|theta|speed|fig7|tests|all]     (default all; OUT=<folder> for the log)
#
# `all` runs the test suite beside the run checks (they only ask whether things work: the machine has cores to
# spare), then the speed checks alone on a quiet machine.
#
# GEM_CHECK_DEVICE=cpu runs the same commands on the CPU, to check the script itself (its numbers mean nothing);
# GEM_CHECK_OVERRIDES="epochs=1 ..." is added to every run.py command (a later value of a key wins).
# Needs gem importable (pip install -e ".[dev]", or PYTHONPATH=<repo> with the dependencies on the path).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gem_gpu_checklist}
mkdir -p "$OUT"
DEV=${GEM_CHECK_DEVICE:-cuda}
RUNS=${RUNS:-/tmp/gem_gpu_runs}
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
PY=${PYTHON:-python3}
read -r -a MORE <<<"${GEM_CHECK_OVERRIDES:-}"

step() {  # step <name> <seconds> <command...>: its output in the log, its status and time in steps.txt
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name: $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "=== $name: rc=$rc in $(($(date +%s) - start)) s"
    echo "$name rc=$rc $(($(date +%s) - start))s" >>"$OUT/steps.txt"
}

trend() {  # the run's status, and its training loss at the start and the end (mean of the first and last tenth)
    $PY - "$1" <<'EOF'
import json, sys
import pandas as pd
d = sys.argv[1]
s = json.load(open(f"{d}/summary.json"))
m = pd.read_parquet(f"{d}/metrics.parquet")
k = max(1, len(m) // 10)
print(f"    {d}: {s['status']} {s.get('reason', '')}, {len(m)} commits, loss {m['loss'].iloc[:k].mean():.3f} -> "
      f"{m['loss'].iloc[-k:].mean():.3f}, val loss {s.get('val_loss')}, wall {s.get('wall_time_s')} s")
EOF
}

smi() {  # GPU memory per process, once a second, while a command runs
    if command -v nvidia-smi >/dev/null; then
        while sleep 1; do
            nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | sed "s/^/$(date +%s) /"
        done >"$OUT/$1" &
        echo $!
    fi
}

run_checks() {
    step env 60 bash -c "nvidia-smi -L; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0))'; nproc"
    for engine in process sim distributed; do
        step "run-$engine" 60 $PY run.py device=$DEV engine=$engine hydra.run.dir=$RUNS/$engine "${MORE[@]}"
        trend "$RUNS/$engine"
    done
    for precision in fp32 bf16; do
        step "alexnet-$precision" 100 $PY run.py device=$DEV model=alexnet_cifar data=synthetic \
            data.synthetic.task=prototypes workers=8 epochs=2 precision=$precision hydra.run.dir=$RUNS/alexnet_$precision "${MORE[@]}"
        trend "$RUNS/alexnet_$precision"
    done
    local pid
    pid=$(smi smi_16_workers.txt)
    step workers-16 90 $PY run.py device=$DEV workers=16 hydra.run.dir=$RUNS/w16 "${MORE[@]}"
    [ -n "${pid:-}" ] && kill "$pid"
    trend "$RUNS/w16"
    # the most GPU memory each process held
    [ -s "$OUT/smi_16_workers.txt" ] && awk -F', ' '{split($1, a, " "); if ($2 + 0 > most[a[2]]) most[a[2]] = $2 + 0}
        END {for (p in most) print "    pid " p ": " most[p] " MiB"}' "$OUT/smi_16_workers.txt"
}

theta_checks() {
    # θ on the workers' GPU (engine.theta_on_gpu, shared by CUDA IPC): one worker gives the losses of sim, which
    # computes everything on the GPU too; a run killed after a checkpoint resumes
    for engine in process sim; do
        step "n1-$engine" 60 $PY run.py device=$DEV workers=1 engine=$engine hydra.run.dir=$RUNS/n1_$engine "${MORE[@]}"
    done
    $PY - "$RUNS" <<'EOF'
import json, sys
import pandas as pd
runs = sys.argv[1]
p, s = (pd.read_parquet(f"{runs}/n1_{e}/metrics.parquet") for e in ("process", "sim"))
where = json.load(open(f"{runs}/n1_process/summary.json")).get("central_device")
same = len(p) == len(s) and (p["loss"].to_numpy() == s["loss"].to_numpy()).all()
gap = (p["loss"] - s["loss"]).abs().max() if len(p) == len(s) else float("nan")
print(f"    n = 1, θ on {where}: process and sim losses {'bit-identical' if same else 'differ'} over {len(p)} and "
      f"{len(s)} commits (largest difference {gap:.3g})")
EOF
    local killed=$RUNS/killed args=(device=$DEV engine=process epochs=8 engine.checkpoint_every=100 "${MORE[@]}")
    setsid $PY run.py "${args[@]}" hydra.run.dir="$killed" >"$OUT/killed.txt" 2>&1 &
    local pid=$! i
    for i in $(seq 240); do [ -f "$killed/checkpoint/manifest.json" ] && break; sleep 0.25; done
    kill -9 -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "    killed after the checkpoint at $(grep -o "\"step\": [0-9]*" "$killed/checkpoint/manifest.json" | head -1)"
    step resume 90 $PY run.py "${args[@]}" resume=true hydra.run.dir="$killed"
    trend "$killed"
}

speed_checks() {
    step gpu-benchmark 150 $PY benchmarks/gpu.py --device $DEV --steps 300
}

fig7_checks() {
    # Fig. 7 on the synthetic stand-in for CIFAR-10 (50,000 training images, as CIFAR's), seed 0 only
    local fig7=(experiment=fig7 device=$DEV data=synthetic data.synthetic.task=prototypes
        data.synthetic.train_size=50000 seed=0 hydra.sweep.dir=$RUNS/fig7 "${MORE[@]}")
    step fig7-plan 60 $PY run.py -m "${fig7[@]}" plan=true
    step fig7 150 $PY run.py -m "${fig7[@]}"
    for d in "$RUNS"/fig7/*/; do [ -f "$d/summary.json" ] && trend "${d%/}"; done
}

test_checks() {
    # tests never need a GPU, and must not break where one is visible
    step pytest 330 $PY -m pytest -q -n 6 -p no:cacheprovider ${TESTS:-}  # TESTS: a subset, where time is short
}

what=${1:-all}
{
    echo "gem GPU checklist: $what on $DEV, $(date -u +%FT%TZ)"
    case $what in
        run) run_checks ;;
        theta) theta_checks ;;
        speed) speed_checks ;;
        fig7) fig7_checks ;;
        tests) test_checks ;;
        all) test_checks >"$OUT/pytest.txt" 2>&1 &
             run_checks; theta_checks; wait; tail -30 "$OUT/pytest.txt"; speed_checks; fig7_checks ;;
        *) echo "usage: $0 [run|theta|speed|fig7|tests|all]"; exit 2 ;;
    esac
    echo "--- steps"
    cat "$OUT/steps.txt"
} 2>&1 | tee -a "$OUT/log.txt"
