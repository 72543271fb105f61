set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log3.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
timeout 120 python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants split128,window256 --batches 65536 --temperature 0.05 --budget_s 100 --output $OUT/ab_t005.json >> $L 2>&1; echo "t0.05 A/B rc=$? at $(el) s" | tee -a $L
timeout $(( 300 - $(el) )) python3 -m pytest -m gpu -n 8 -v -ra -p no:cacheprovider tests/test_losses.py tests/test_cached_loss.py tests/test_trainer.py tests/test_user_paths.py tests/test_sentence_transformers.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
tail -3 $OUT/gpu_tests.txt; grep -E "FAILED|ERROR" $OUT/gpu_tests.txt | head
grep -E "rc=" $L
