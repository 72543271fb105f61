set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log1.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
timeout 90 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider -k "window256 or blocked or auto" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
B="python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --variants window256,window256_by_window,split128"
timeout $(( 390 - $(el) )) $B --batches 4096,8192,16384,32768,65536,131072 --budget_s $(( 350 - $(el) )) --output $OUT/curve_t1.json >> $L 2>&1; echo "curve t1 rc=$? at $(el) s" | tee -a $L
M="python3 benchmarks/results/session14/micro.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --temperature 1.0"
S="w256:doc_window=256;w256d:doc_window=256,window_major=doc_grad;w256qd:doc_window=256,window_major=query_grad+doc_grad;w256all:doc_window=256,window_major=all;w128all:doc_window=128,window_major=all;w512all:doc_window=512,window_major=all;w256f256:doc_window=256,bn_forward=256;w256f256w8:doc_window=256,bn_forward=256,warps=8"
timeout $(( 490 - $(el) )) $M --bd 1024 --shapes "$S" --output $OUT/micro_bd1024_t1.json --only w256,w256d,w256qd,w256all,w128all,w512all,w256f256,w256f256w8 >> $L 2>&1; echo "micro1024 rc=$? at $(el) s" | tee -a $L
timeout $(( 585 - $(el) )) $B --batches 65536 --temperature 0.05 --budget_s $(( 555 - $(el) )) --output $OUT/ab_t005.json >> $L 2>&1; echo "t0.05 A/B rc=$? at $(el) s" | tee -a $L
grep -E "passed|failed|rc=|fused:|blocked" $L | cut -c1-400
