set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log3.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
grep -n "^GPU_TILES" gradcache_sparton/losses/fused_lse.py | tee -a $L
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_fused_lse_gpu.py -k "hot1024 or hot_columns or blocked or export_in_bf16" tests/test_user_paths.py::test_gpu_train_evaluate_mine_export_in_bf16 >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
timeout $(( 200 - $(el) )) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 131072,16384 \
    --variants window256_stored,window256_stored_hot1024 --budget_s $(( 190 - $(el) )) --output $OUT/curve_t1.json >> $L 2>&1; echo "t1 curve rc=$? at $(el) s" | tee -a $L
grep -E "rc=|passed|failed|FAIL|fused:|blocked \{|GPU_TILES" $L | cut -c1-300
