# Session 21, call 3: more hot columns (TileShape.hot_min_tile_fraction) as whole losses at B 65,536 against the
# default, with the fp64 check of each (bench_loss_kernel), within CAP s (`bash call3.sh CAP`, default 420).
# Carry .whl .gpu.
set -u
R0=$PWD; T0=$(date +%s); CAP=${1:-420}
el() { echo $(( $(date +%s) - T0 )); }
left() { local t=$(( $1 - $(el) )); [ $t -lt 5 ] && t=5; echo $t; }  # seconds until $1, at least 5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git -C $R0 log -1 --format=%h 2>/dev/null; python3 -c "import torch, triton, transformers, sentence_transformers; print(torch.__version__, triton.__version__, transformers.__version__, sentence_transformers.__version__)"; } > $L 2>&1
V=window256_stored_hot1024_query_split_store256
for h in hot1536at35 hot2048at25 hot3072at25; do V=$V,window256_stored_${h}_query_split_store256; done
timeout $(left $CAP) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 65536 --budget_s $(left $(( CAP - 20 ))) --output $OUT/ab_hot_65536.json --variants $V >> $L 2>&1; echo "ab rc=$? at $(el) s" | tee -a $L
grep -E "rc=|fused:|blocked |Error|error" $L | cut -c1-300
