set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log1.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
timeout 360 python3 benchmarks/results/session19/block_sweep.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --output $OUT/block_sweep.json >> $L 2>&1; echo "sweep rc=$? at $(el) s" | tee -a $L
python3 - "$OUT/block_sweep_ab.json" > /tmp/best_variant <<'PY'
import json, sys
ab = json.load(open(sys.argv[1]))["ab"][0]
times = {k.split(":", 1)[1]: v["total_s"] for k, v in ab.items() if k.startswith("fused:") and isinstance(v, dict) and "total_s" in v}
print(min(times, key=times.get))
PY
echo "best variant: $(cat /tmp/best_variant) at $(el) s" | tee -a $L
grep -E "rc=|best|block_ms|fused:|blocked \{|Error|error" $L | cut -c1-420
