set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
CUR=$R0/.gpu/cur:$R0:/tmp/site
PREV=$R0/.gpu/prev:$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git log --oneline -1; } > $L 2>&1
X="python3 .gpu/explore/explore.py --new --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt --only new-max1024"
echo "== C1 this T=1 (encodes)" >> $L; timeout 100 $X --temperature 1.0 --ref /tmp/r1.pt --budget_s 80 --output $OUT/c1_this_t1.json >> $L 2>&1; echo "c1 rc=$? at $(el) s" | tee -a $L
echo "== C2 6d98248 T=1" >> $L; PYTHONPATH=$PREV timeout 45 $X --temperature 1.0 --ref /tmp/r1.pt --budget_s 30 --output $OUT/c2_6d98248_t1.json >> $L 2>&1; echo "c2 rc=$? at $(el) s" | tee -a $L
echo "== C3 5b8d353 T=1" >> $L; PYTHONPATH=$CUR timeout 45 $X --temperature 1.0 --ref /tmp/r1.pt --budget_s 30 --output $OUT/c3_5b8d353_t1.json >> $L 2>&1; echo "c3 rc=$? at $(el) s" | tee -a $L
echo "== C4 this T=0.05" >> $L; timeout 45 $X --temperature 0.05 --ref /tmp/r005.pt --budget_s 30 --output $OUT/c4_this_t005.json >> $L 2>&1; echo "c4 rc=$? at $(el) s" | tee -a $L
echo "== C5 5b8d353 T=0.05" >> $L; PYTHONPATH=$CUR timeout 45 $X --temperature 0.05 --ref /tmp/r005.pt --budget_s 30 --output $OUT/c5_5b8d353_t005.json >> $L 2>&1; echo "c5 rc=$? at $(el) s" | tee -a $L
grep -E "^== | fwd |FAILED|Error" $L | tail -20
timeout $(( 560 - $(el) )) python3 -m pytest -m gpu -n 8 -v -ra -k "not test_docs_on_gpu" -p no:cacheprovider > $OUT/gpu_suite_h100.txt 2>&1; echo "suite rc=$? at $(el) s" | tee -a $L
tail -4 $OUT/gpu_suite_h100.txt
