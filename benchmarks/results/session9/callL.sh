set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
OLD=$R0/.gpu/base5b6:$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; } > $L 2>&1
timeout 90 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
grep -E "passed|failed" $L | tail -2
X="python3 .gpu/explore/explore.py --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt --budget_s 80"
echo "== E1 inline T=0.05" >> $L; timeout 110 $X --new --only new-max1024 --temperature 0.05 --ref /tmp/r005.pt --profile --output $OUT/e1_inline_t005.json >> $L 2>&1; echo "e1 rc=$? at $(el) s" | tee -a $L
echo "== E4 inline T=1" >> $L; timeout 60 $X --new --only new-max1024 --temperature 1.0 --ref /tmp/r1.pt --output $OUT/e4_inline_t1.json >> $L 2>&1; echo "e4 rc=$? at $(el) s" | tee -a $L
echo "== E5 old T=1" >> $L; PYTHONPATH=$OLD timeout 60 $X --only base --temperature 1.0 --ref /tmp/r1.pt --output $OUT/e5_old_t1.json >> $L 2>&1; echo "e5 rc=$? at $(el) s" | tee -a $L
echo "== E2 old T=0.05" >> $L; PYTHONPATH=$OLD timeout 60 $X --only base --temperature 0.05 --ref /tmp/r005.pt --output $OUT/e2_old_t005.json >> $L 2>&1; echo "e2 rc=$? at $(el) s" | tee -a $L
grep -E " fwd |Error" $L | tail -12
timeout $(( 275 - $(el) )) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 16384,32768,65536,131072 --budget_s $(( 250 - $(el) )) --variants columns --output $OUT/loss_curve.json >> $L 2>&1; echo "curve rc=$? at $(el) s" | tee -a $L
grep -E "^[0-9]+ (blocked|fused)" $L
