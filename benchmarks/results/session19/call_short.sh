set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
timeout 200 python3 benchmarks/results/session19/block_sweep.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --output $OUT/block_sweep.json >> $L 2>&1; echo "sweep rc=$? at $(el) s" | tee -a $L
timeout $(( 275 - $(el) )) python3 -m pytest -q -p no:cacheprovider tests/test_fused_lse_gpu.py -k "query_split or hot_columns" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
grep -E "rc=|block_ms|buffers|passed|failed|fused:|Error|error" $L | cut -c1-400
