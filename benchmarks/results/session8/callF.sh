set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$R0:/tmp/site TOKENIZERS_PARALLELISM=false
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; } > $L 2>&1
# (1) the loss curve: the fused kernel (GPU_TILES 'columns') against the blocked path, B 16,384 .. 131,072, one process
timeout 300 python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 16384,32768,65536,131072 --budget_s 250 --variants columns --output $OUT/loss_curve.json > /tmp/lc.log 2>&1; echo "loss curve rc=$? at $(el) s" | tee -a $L
tail -c 2500 /tmp/lc.log >> $L
# (2) the docs pages no GPU suite run has reached yet
LEFT=$(( 585 - $(el) ))
timeout $LEFT python3 -m pytest -m gpu -n 2 -v -ra -p no:cacheprovider -k "test_docs_on_gpu and (distillation or training)" tests/test_docs.py > $OUT/docs_gpu.txt 2>&1; echo "docs rc=$? at $(el) s" | tee -a $OUT/docs_gpu.txt
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/docs_gpu.txt | tail -8
