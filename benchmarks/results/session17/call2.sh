set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log2.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L 2>&1
timeout 540 python3 benchmarks/results/session17/hot_sweep.py.txt --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact --output $OUT/hot_sweep.json >> $L 2>&1; echo "sweep rc=$? at $(el) s" | tee -a $L
grep -E "rc=|\"ms\"|best|fused:|blocked \{|Error|error" $L | cut -c1-330
