set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ln -sfn $R0/gradcache_sparton/resources $R0/.prev/gradcache_sparton/resources  # the same files at 1d51c95
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; PYTHONPATH=/tmp/site python3 -c "import torch, triton, transformers, sentence_transformers; print(torch.__version__, triton.__version__, transformers.__version__, sentence_transformers.__version__)"; } > $L 2>&1
export PYTHONPATH=$R0:/tmp/site
# (1) the block sweep and the whole loss A/B at B 65,536 with its fp64 check
timeout 240 python3 benchmarks/results/session19/block_sweep.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --output $OUT/block_sweep.json >> $L 2>&1; echo "sweep rc=$? at $(el) s" | tee -a $L
BEST=$(python3 - "$OUT/block_sweep_ab.json" <<'PY'
import json, sys
ab = json.load(open(sys.argv[1]))["ab"][0]
times = {k.split(":", 1)[1]: v["total_s"] for k, v in ab.items() if k.startswith("fused:") and isinstance(v, dict) and "total_s" in v}
print(min(times, key=times.get))
PY
)
BEST=${BEST:-window256_stored_hot1024_query_split_store256}; echo "best variant: $BEST at $(el) s" | tee -a $L
# (2) the GPU tests of the stored weights' settings
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fused_lse_gpu.py -k "query or matches_blocked or auto" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
# (3) the curve: the best variant against 1d51c95 (the previous default); `bash call.sh short` stops before it
if [ "${1:-}" != short ]; then
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
timeout $(( 440 - $(el) )) python3 -c "import sys; from gradcache_sparton.losses import fused_lse as F; F.GPU_TILES = F.VARIANTS[sys.argv.pop(1)]; from benchmarks.bench_loss_curve import main; sys.exit(main(sys.argv[1:]))" $BEST ${C#python3 -m benchmarks.bench_loss_curve } --budget_s $(( 430 - $(el) )) --out $OUT/curve_head.json >> $L 2>&1; echo "curve $BEST rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev && PYTHONPATH=$R0/.prev:/tmp/site timeout $(( 540 - $(el) )) $C --budget_s $(( 530 - $(el) )) --out $OUT/curve_1d51c95.json) >> $L 2>&1; echo "curve 1d51c95 rc=$? at $(el) s" | tee -a $L
fi
grep -E "rc=|best|block_ms|buffers|passed|failed|fused:|^ +[0-9]+ +text|Error|error" $L | cut -c1-400
