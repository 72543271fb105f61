set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; } > $L 2>&1
timeout 110 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
grep -E "PASSED|FAILED|ERROR|passed|failed" $L | tail -8
echo "== new kernels, encode + SPARSE_TILE_MAX 1024" >> $L
timeout 120 python3 .gpu/explore/explore.py --new --only new-max1024 --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt --budget_s 100 --output $OUT/explore_new1.json >> $L 2>&1; echo "new1 rc=$? at $(el) s" | tee -a $L
echo "== old kernels (5b6d1e8)" >> $L
PYTHONPATH=$R0/.gpu/base5b6:$R0:/tmp/site timeout 90 python3 .gpu/explore/explore.py --only base --reps_cache /tmp/reps.pt --ref /tmp/ref.pt --beir_path $R0/.gpu/data/scifact --budget_s 60 --output $OUT/explore_old.json >> $L 2>&1; echo "old rc=$? at $(el) s" | tee -a $L
echo "== new kernels, settings" >> $L
timeout 120 python3 .gpu/explore/explore.py --new --only new-max1024,new-max0,new-max4096,new-max1024-bn128w8,new-max4096-bn128w4 --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt --ref /tmp/ref.pt --budget_s 90 --output $OUT/explore_new.json >> $L 2>&1; echo "new rc=$? at $(el) s" | tee -a $L
grep -E " fwd |FAILED|Error" $L | tail -20
timeout $(( 480 - $(el) )) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 8192,16384,32768,65536,131072 --budget_s $(( 440 - $(el) )) --variants columns --output $OUT/loss_curve.json >> $L 2>&1; echo "curve rc=$? at $(el) s" | tee -a $L
grep -E "^[0-9]+ (blocked|fused)" $L
