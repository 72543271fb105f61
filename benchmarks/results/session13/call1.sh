set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
timeout 80 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
M="python3 benchmarks/results/session13/micro.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --temperature 1.0"
S="p1:parts=1;w256:doc_window=256;w512:doc_window=512"
timeout 110 $M --bd 1024 --shapes "$S" --only split128,p1,w256,w512 --output $OUT/micro_bd1024_t1.json >> $L 2>&1; echo "micro1024 rc=$? at $(el) s" | tee -a $L
REM=$(( 300 - $(el) ))
timeout $REM python3 - "$OUT" "$R0" $(( REM - 15 )) >> $L 2>&1 <<'PY'
import json, sys
from gradcache_sparton.losses import fused_lse
from benchmarks import bench_loss_kernel
out, root, budget = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [r for r in json.load(open(f"{out}/micro_bd1024_t1.json"))["results"] if "forward_s" in r]
windowed = [r for r in rows if r["shape"]["doc_window"] and r["parts"] == 2]
best = min(windowed, key=lambda r: r["forward_s"] + r["backward_both_s"]) if windowed else None
name = "window256"
if best is not None:
    fused_lse.VARIANTS["picked"] = fused_lse.TileShape(**best["shape"])
    name = "picked"
    print("picked", best["name"], best["shape"], flush=True)
argv = ["--beir_path", f"{root}/.gpu/data/scifact", "--variants", f"split128,{name}", "--batches",
        "65536", "--budget_s", budget, "--output", f"{out}/loss_curve_t1.json"]
sys.argv = ["benchmarks.bench_loss_kernel", *argv]
sys.exit(bench_loss_kernel.main(argv))
PY
echo "curve rc=$? at $(el) s" | tee -a $L
grep -E "passed|failed|rc=|^\{|picked" $L | cut -c1-700
