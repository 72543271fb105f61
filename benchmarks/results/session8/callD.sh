set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; PYTHONPATH=/tmp/site python3 -c "import torch,triton,transformers,accelerate,sentence_transformers as st;print(torch.__version__,triton.__version__,transformers.__version__,accelerate.__version__,st.__version__)"; date -u; } > $L 2>&1
# (1) the fused loss kernel's settings against the blocked path, B 65,536, one process, a quiet GPU
PYTHONPATH=$R0:/tmp/site timeout 260 python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 65536 --budget_s 200 --variants columns,entries,lanes,entries-w8,lanes-w8,entries-bk128,entries-2pass --output $OUT/loss_kernel.json > /tmp/lk.log 2>&1; echo "loss_kernel rc=$? at $(el) s" | tee -a $L
tail -c 4000 /tmp/lk.log >> $L; tail -c 1500 /tmp/lk.log
# (2) the head: 540dff2 (A) and this tree (B), each in its own process, A B A B while time allows
for i in 1 2; do
  [ $(el) -gt 420 ] && break
  PYTHONPATH=$R0/.gpu/base540:$R0:/tmp/site timeout 80 python3 benchmarks/head_regression.py --out $OUT/head_a$i.json > /tmp/ha$i.log 2>&1; echo "head A$i rc=$? at $(el) s" | tee -a $L; tail -c 600 /tmp/ha$i.log >> $L
  PYTHONPATH=$R0:/tmp/site timeout 80 python3 benchmarks/head_regression.py --out $OUT/head_b$i.json > /tmp/hb$i.log 2>&1; echo "head B$i rc=$? at $(el) s" | tee -a $L; tail -c 600 /tmp/hb$i.log >> $L
done
PYTHONPATH=$R0:/tmp/site python3 benchmarks/head_regression.py --compare $OUT/head_a*.json --to $OUT/head_b*.json >> $L 2>&1; echo "compare rc=$?" | tee -a $L
# (3) the gpu suite, docs pages aside, verbose
LEFT=$(( 588 - $(el) ))
PYTHONPATH=$R0:/tmp/site timeout $LEFT python3 -m pytest -m gpu -n 8 -v -ra -p no:cacheprovider -k "not test_docs_on_gpu" > $OUT/gpu_suite.txt 2>&1; echo "suite rc=$? at $(el) s" | tee -a $L
grep -E "FAILED|ERROR|passed|failed" $OUT/gpu_suite.txt | tail -15
