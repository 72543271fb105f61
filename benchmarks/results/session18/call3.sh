set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ln -sfn $R0/gradcache_sparton/resources $R0/.prev/gradcache_sparton/resources  # the same files at d4a20a3
L=$OUT/log3.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; PYTHONPATH=/tmp/site python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
export PYTHONPATH=$R0:/tmp/site
grep -n "^GPU_TILES\|^QUERY_GRAD_TILE" gradcache_sparton/losses/fused_lse.py gradcache_sparton/losses/stored_weights_triton.py .prev/gradcache_sparton/losses/fused_lse.py | tee -a $L
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
timeout 120 $C --budget_s 110 --out $OUT/curve_head.json >> $L 2>&1; echo "curve HEAD rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev && PYTHONPATH=$R0/.prev:/tmp/site timeout $(( 250 - $(el) )) $C --budget_s $(( 240 - $(el) )) --out $OUT/curve_d4a20a3.json) >> $L 2>&1; echo "curve d4a20a3 rc=$? at $(el) s" | tee -a $L
grep -E "rc=|^ +[0-9]+ +text|GPU_TILES|QUERY_GRAD" $L | cut -c1-300
