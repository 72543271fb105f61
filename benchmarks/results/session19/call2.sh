set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ln -sfn $R0/gradcache_sparton/resources $R0/.prev/gradcache_sparton/resources  # the same files at 1d51c95
L=$OUT/log2.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; PYTHONPATH=/tmp/site python3 -c "import torch, triton, transformers, sentence_transformers; print(torch.__version__, triton.__version__, transformers.__version__, sentence_transformers.__version__)"; } > $L 2>&1
export PYTHONPATH=$R0:/tmp/site
grep -n "^GPU_TILES" gradcache_sparton/losses/fused_lse.py .prev/gradcache_sparton/losses/fused_lse.py | tee -a $L
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
BEST=$(cat /tmp/best_variant 2>/dev/null || echo window256_stored_hot1024_query_split_store256); echo "curve HEAD with GPU_TILES = $BEST" | tee -a $L
timeout 200 python3 -c "import sys; from gradcache_sparton.losses import fused_lse as F; F.GPU_TILES = F.VARIANTS[sys.argv.pop(1)]; from benchmarks.bench_loss_curve import main; sys.exit(main(sys.argv[1:]))" $BEST ${C#python3 -m benchmarks.bench_loss_curve } --budget_s 190 --out $OUT/curve_head.json >> $L 2>&1; echo "curve HEAD rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev && PYTHONPATH=$R0/.prev:/tmp/site timeout $(( 400 - $(el) )) $C --budget_s $(( 390 - $(el) )) --out $OUT/curve_1d51c95.json) >> $L 2>&1; echo "curve 1d51c95 rc=$? at $(el) s" | tee -a $L
timeout $(( 585 - $(el) )) python3 -m pytest -q -p no:cacheprovider tests/test_fused_lse_gpu.py tests/test_user_paths.py::test_gpu_train_evaluate_mine_export_in_bf16 >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
grep -E "rc=|passed|failed|FAIL|^ +[0-9]+ +text|GPU_TILES" $L | cut -c1-300
