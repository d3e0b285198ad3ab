# Call 4: the stacked products' and the expert FFN's GEMV forms without the ops around them (reduce sum / acc at T <= 4: x goes in
# unpadded; one K split: no sum over splits) against the default (tl.dot on x padded to 16 rows, 4 K splits summed):
# the 24-layer T=1 window graph (decode_bench, pipelined ms) per tuning file of ../tuning/, the default first and
# last; then the window's profile (every kernel, its launches) for the default and the fastest form; then the
# generate loop (peer_bench spec=0 and Qwen3's sampling with default settings) for both.
# SHORT=1 (little device time left): the default once, three forms, the profiles, spec=0 only in the loop; SHORT=2:
# two forms, then the fastest's profile and loop only.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c4; mkdir -p $D
PROFILED="default"; LOOPED="default"
if [ "${SHORT:-0}" = 2 ]; then ARMS="default sum-both sum-all"; LOOP="spec=0"; PROFILED=""; LOOPED=""
elif [ "${SHORT:-0}" = 1 ]; then ARMS="default sum-both sum-all acc-split1"; LOOP="spec=0"
else ARMS="default sum-qkv sum-both sum-all sum-qkv16 acc-split1 default"; LOOP="spec=0;temperature=0.7,top_k=20,top_p=0.8"; fi
pack() { tar czf $OUT/c4.tgz -C $OUT c4; }  # after each step: a call cut by its limit still brings back what it did
TD=benchmarks/results/h100-2026-12-07-kernels/tuning
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
for arm in $ARMS; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 60 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1 --hf=off \
    --iters=30 --json=$D/window-$arm-$SECONDS.json > $D/window-$arm-$SECONDS.log 2>&1
  echo "window $arm rc=$? at $((SECONDS - T0)) s: $(python3 -c "import json,glob; f=sorted(glob.glob('$D/window-$arm-*.json'))[-1]; r=json.load(open(f))['rows'][0]; print(f\"synced {r['ms_per_step']:.3f} ms, pipelined {r['ms_per_step_pipelined']:.3f} ms\")" 2>&1 | tail -1)"; pack
done
best=$(python3 - "$D" <<'PY'
import glob, json, sys, collections
t = collections.defaultdict(list)
for f in glob.glob(f"{sys.argv[1]}/window-*.json"):
    arm = f.split("/window-")[1].rsplit("-", 1)[0]
    try:
        t[arm].append(json.load(open(f))["rows"][0]["ms_per_step_pipelined"])
    except Exception:
        pass
arms = {a: min(v) for a, v in t.items() if a != "default"}
print(min(arms, key=arms.get) if arms else "default")
PY
)
echo "fastest form: $best"
for arm in $PROFILED $best; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 45 python3 -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=24 --windows=1 \
    --json=$D/profile-$arm.json > $D/profile-$arm.log 2>&1
  echo "profile $arm rc=$? at $((SECONDS - T0)) s"; grep -E "op time" $D/profile-$arm.log | cut -c1-200; pack
done
for arm in $LOOPED $best; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 70 python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 --ours="$LOOP" \
    --warmup_arm=false --json=$D/p24-$arm.json > $D/p24-$arm.log 2>&1
  echo "loop $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\| strata" $D/p24-$arm.log | cut -c1-160; pack
done
echo "done at $((SECONDS - T0)) s"
