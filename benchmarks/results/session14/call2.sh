set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log2.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers, ir_measures; print(torch.__version__, triton.__version__, transformers.__version__, ir_measures.__version__)"; } > $L 2>&1
timeout 70 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider -k "window256_forward256 or window256_wide or auto" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
B="python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants window256,window256_forward256,window256_wide"
timeout $(( 200 - $(el) )) $B --batches 65536 --budget_s $(( 165 - $(el) )) --output $OUT/ab_t1.json >> $L 2>&1; echo "t1 A/B rc=$? at $(el) s" | tee -a $L
M="python3 benchmarks/results/session14/micro.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --temperature 1.0"
S="w256:doc_window=256;w256f256:doc_window=256,bn_forward=256;b128n64:bm=128,bn_forward=64,bn_scan=64,bn_backward=64,doc_window=256;b128n64w8:bm=128,bn_forward=64,bn_scan=64,bn_backward=64,doc_window=256,warps=8;b128w8:bm=128,doc_window=256,warps=8"
timeout $(( 275 - $(el) )) $M --bd 1024 --shapes "$S" --output $OUT/micro2_bd1024_t1.json --only w256,w256f256,b128n64,b128n64w8,b128w8 >> $L 2>&1; echo "micro1024 rc=$? at $(el) s" | tee -a $L
timeout $(( 345 - $(el) )) $B --batches 65536 --temperature 0.05 --budget_s $(( 320 - $(el) )) --output $OUT/ab_t005.json >> $L 2>&1; echo "t0.05 A/B rc=$? at $(el) s" | tee -a $L
timeout $(( 430 - $(el) )) python3 -m pytest tests/test_user_paths.py -m gpu -v -ra -p no:cacheprovider -k "test_gpu_train_evaluate_mine_export_in_bf16" > $OUT/user_path.txt 2>&1; echo "user path rc=$? at $(el) s" | tee -a $L
tail -3 $OUT/user_path.txt
grep -E "passed|failed|rc=|fused:|blocked|^\{\"name" $L | cut -c1-330
