set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log6.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
timeout 200 python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 65536 \
    --variants window256_one_kernel,window256_stored --budget_s 180 --output $OUT/ab_t1.json >> $L 2>&1; echo "t1 A/B rc=$? at $(el) s" | tee -a $L
grep -E "rc=|fused:|blocked" $L | cut -c1-300
