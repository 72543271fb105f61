set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ln -sfn $R0/gradcache_sparton/resources $R0/.prev/gradcache_sparton/resources  # the same files at c03531e
L=$OUT/log1.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; PYTHONPATH=/tmp/site python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
export PYTHONPATH=$R0:/tmp/site
timeout 150 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider -k "stored or bits or auto or blocked" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
timeout $(( 230 - $(el) )) python3 benchmarks/results/session16/micro.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --output $OUT/micro_t1.json >> $L 2>&1; echo "micro rc=$? at $(el) s" | tee -a $L
B="python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants window256_bits,window256_stored"
timeout $(( 340 - $(el) )) $B --batches 65536 --budget_s $(( 325 - $(el) )) --output $OUT/ab_t1.json >> $L 2>&1; echo "t1 A/B rc=$? at $(el) s" | tee -a $L
# The curve's default: window256_bits where it was faster in total at 1.0 (this copy only; the commit follows)
WIN=$(python3 - <<'PY'
import json, os
point = json.load(open(os.environ["OUT"] + "/ab_t1.json"))["ab"][0]
b, s = point["fused:window256_bits"].get("total_s"), point["fused:window256_stored"].get("total_s")
print("bits" if b and s and b < s else "stored", b, s)
PY
)
echo "the curve's default: $WIN" | tee -a $L
case "$WIN" in bits*) sed -i 's/^GPU_TILES = VARIANTS\["window256_stored"\]/GPU_TILES = VARIANTS["window256_bits"]/' gradcache_sparton/losses/fused_lse.py;; esac
grep -n "^GPU_TILES" gradcache_sparton/losses/fused_lse.py | tee -a $L
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
timeout $(( 420 - $(el) )) $C --budget_s $(( 410 - $(el) )) --out $OUT/curve_head.json >> $L 2>&1; echo "curve HEAD rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev && PYTHONPATH=$R0/.prev:/tmp/site timeout $(( 500 - $(el) )) $C --budget_s $(( 490 - $(el) )) --out $OUT/curve_c03531e.json) >> $L 2>&1; echo "curve c03531e rc=$? at $(el) s" | tee -a $L
timeout $(( 590 - $(el) )) $B --batches 65536 --temperature 0.05 --budget_s $(( 575 - $(el) )) --output $OUT/ab_t005.json >> $L 2>&1; echo "t0.05 A/B rc=$? at $(el) s" | tee -a $L
grep -E "passed|failed|rc=|fused:|blocked|^ +[0-9]+ +text|query_pass" $L | cut -c1-400
