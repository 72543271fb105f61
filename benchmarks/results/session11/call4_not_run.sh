set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
timeout 50 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
B="python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants split128"
timeout $(( 215 - $(el) )) $B --batches 16384,32768,65536,131072 --budget_s $(( 205 - $(el) )) --output $OUT/loss_curve_t1.json >> $L 2>&1; echo "curve rc=$? at $(el) s" | tee -a $L
grep -E "^[0-9]+ (blocked|fused)|rc=|passed|failed" $L
