set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log2.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git log --oneline -1 2>/dev/null; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
timeout 150 python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants split128 --batches 4096,8192,16384 --budget_s 120 --output $OUT/small_b_t1.json >> $L 2>&1; echo "small-B curve rc=$? at $(el) s" | tee -a $L
timeout $(( 560 - $(el) )) python3 -m pytest -m gpu -n 8 -v -ra -p no:cacheprovider -k "not test_docs_on_gpu" > $OUT/gpu_suite.txt 2>&1; echo "gpu suite rc=$? at $(el) s" | tee -a $L
tail -5 $OUT/gpu_suite.txt; grep -E "FAILED|ERROR" $OUT/gpu_suite.txt | head -20
grep -E "rc=" $L
