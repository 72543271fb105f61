set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
CUR=$R0/.gpu/cur:$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git log --oneline -1; } > $L 2>&1
timeout 90 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
grep -E "passed|failed" $L | tail -2
X="python3 .gpu/explore/explore.py --new --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt"
ALL=new-max1024,new-max2048,new-max4096,new-scan64-max1024,new-w8-max1024
echo "== B1 new T=0.05 (encodes)" >> $L; timeout 150 $X --only $ALL --temperature 0.05 --ref /tmp/r005.pt --budget_s 120 --output $OUT/b1_new_t005.json >> $L 2>&1; echo "b1 rc=$? at $(el) s" | tee -a $L
echo "== B2 cur (5b8d353) T=0.05" >> $L; PYTHONPATH=$CUR timeout 50 $X --only new-max1024 --temperature 0.05 --ref /tmp/r005.pt --budget_s 30 --output $OUT/b2_cur_t005.json >> $L 2>&1; echo "b2 rc=$? at $(el) s" | tee -a $L
echo "== B3 cur (5b8d353) T=1" >> $L; PYTHONPATH=$CUR timeout 50 $X --only new-max1024 --temperature 1.0 --ref /tmp/r1.pt --budget_s 30 --output $OUT/b3_cur_t1.json >> $L 2>&1; echo "b3 rc=$? at $(el) s" | tee -a $L
echo "== B4 new T=1" >> $L; timeout 80 $X --only new-max1024,new-w8-max1024 --temperature 1.0 --ref /tmp/r1.pt --budget_s 60 --output $OUT/b4_new_t1.json >> $L 2>&1; echo "b4 rc=$? at $(el) s" | tee -a $L
grep -E "^== | fwd |FAILED|Error" $L | tail -30
timeout $(( 540 - $(el) )) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 16384,32768,65536,131072 --budget_s $(( 500 - $(el) )) --variants columns --output $OUT/loss_curve.json >> $L 2>&1; echo "curve rc=$? at $(el) s" | tee -a $L
grep -E "^[0-9]+ (blocked|fused)" $L
