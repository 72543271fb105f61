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
ALL=new-max1024,new-max1024-bn128w4,new-max1024-bn128w8,new-max1024-bk32-bn128w8,new-max1024-bn128w8-s2
echo "== A1 cur (5b8d353) T=1" >> $L; PYTHONPATH=$CUR timeout 120 $X --only new-max1024 --temperature 1.0 --ref /tmp/r1.pt --budget_s 100 --output $OUT/a1_cur_t1.json >> $L 2>&1; echo "a1 rc=$? at $(el) s" | tee -a $L
echo "== A2 switch T=1" >> $L; timeout 110 $X --only $ALL --temperature 1.0 --ref /tmp/r1.pt --budget_s 90 --output $OUT/a2_switch_t1.json >> $L 2>&1; echo "a2 rc=$? at $(el) s" | tee -a $L
echo "== A3 cur (5b8d353) T=0.05" >> $L; PYTHONPATH=$CUR timeout 60 $X --only new-max1024 --temperature 0.05 --ref /tmp/r005.pt --budget_s 40 --output $OUT/a3_cur_t005.json >> $L 2>&1; echo "a3 rc=$? at $(el) s" | tee -a $L
echo "== A4 switch T=0.05" >> $L; timeout 100 $X --only $ALL --temperature 0.05 --ref /tmp/r005.pt --budget_s 80 --output $OUT/a4_switch_t005.json >> $L 2>&1; echo "a4 rc=$? at $(el) s" | tee -a $L
echo "== A5 cur (5b8d353) T=1 again" >> $L; PYTHONPATH=$CUR timeout 40 $X --only new-max1024 --temperature 1.0 --ref /tmp/r1.pt --budget_s 30 --output $OUT/a5_cur_t1.json >> $L 2>&1; echo "a5 rc=$? at $(el) s" | tee -a $L
grep -E "^== | fwd |FAILED|Error" $L | tail -30
