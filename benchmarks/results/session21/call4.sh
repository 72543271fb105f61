# Session 21, call 4 (GPU_TILES = window256_stored_hot2048at25_query_split_store256): (1) the whole GPU test file of
# the fused kernel; (2) the curve 16,384-131,072 of the new default against 255f7e4 (.prev2: the default before,
# window256_stored_hot1024_query_split_store256), within CAP s (`bash call4.sh CAP`, default 400). Carry .whl .gpu .prev2.
set -u
R0=$PWD; T0=$(date +%s); CAP=${1:-400}
el() { echo $(( $(date +%s) - T0 )); }
left() { local t=$(( $1 - $(el) )); [ $t -lt 5 ] && t=5; echo $t; }  # seconds until $1, at least 5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
ln -sfn $R0/gradcache_sparton/resources $R0/.prev2/gradcache_sparton/resources
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers, sentence_transformers; print(torch.__version__, triton.__version__, transformers.__version__, sentence_transformers.__version__)"; } > $L 2>&1
timeout $(left $(( CAP - 150 ))) python3 -m pytest -q -p no:cacheprovider tests/test_fused_lse_gpu.py >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
timeout $(left $(( CAP - 70 ))) $C --budget_s $(left $(( CAP - 80 ))) --out $OUT/curve_head.json >> $L 2>&1; echo "curve head rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev2 && PYTHONPATH=$R0/.prev2:/tmp/site timeout $(left $CAP) $C --budget_s $(left $(( CAP - 10 ))) --out $OUT/curve_255f7e4.json) >> $L 2>&1; echo "curve 255f7e4 rc=$? at $(el) s" | tee -a $L
grep -E "rc=|passed|failed|^ +[0-9]+ +text|Error|error" $L | cut -c1-300
