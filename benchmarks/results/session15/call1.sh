set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ln -sfn $R0/gradcache_sparton/resources $R0/.prev/gradcache_sparton/resources  # the same files at 914af57; carried once
L=$OUT/log1.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; PYTHONPATH=/tmp/site python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
export PYTHONPATH=$R0:/tmp/site
timeout 100 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider -k "forward256 or stored or auto or blocked" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
timeout $(( 205 - $(el) )) $C --budget_s $(( 195 - $(el) )) --out $OUT/curve_head.json >> $L 2>&1; echo "curve HEAD rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev && PYTHONPATH=$R0/.prev:/tmp/site timeout $(( 320 - $(el) )) $C --budget_s $(( 310 - $(el) )) --out $OUT/curve_914af57.json) >> $L 2>&1; echo "curve 914af57 rc=$? at $(el) s" | tee -a $L
B="python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants window256_forward256,window256,window256_stored"
timeout $(( 420 - $(el) )) $B --batches 65536 --budget_s $(( 400 - $(el) )) --output $OUT/ab_t1.json >> $L 2>&1; echo "t1 A/B rc=$? at $(el) s" | tee -a $L
timeout $(( 505 - $(el) )) python3 -m pytest tests/test_user_paths.py -m gpu -v -p no:cacheprovider -k test_gpu_train_evaluate_mine_export_in_bf16 >> $L 2>&1; echo "bf16 user path rc=$? at $(el) s" | tee -a $L
grep -E "passed|failed|rc=|fused:|blocked|^ +[0-9]+ +text" $L | cut -c1-300
