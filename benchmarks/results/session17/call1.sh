set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log1.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
V=window256_stored,window256_stored_hot256,window256_stored_hot512,window256_stored_hot1024
timeout 230 python3 benchmarks/results/session17/micro.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --variants $V --output $OUT/micro_t1.json >> $L 2>&1; echo "micro rc=$? at $(el) s" | tee -a $L
timeout $(( 560 - $(el) )) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 65536 \
    --variants $V --budget_s $(( 540 - $(el) )) --output $OUT/ab_t1.json >> $L 2>&1; echo "t1 A/B rc=$? at $(el) s" | tee -a $L
grep -E "rc=|fused:|blocked|backward_ms|Error|error" $L | cut -c1-400
