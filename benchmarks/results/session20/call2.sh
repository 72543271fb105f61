# Session 20, call 2 (after the DocBlocks sync fix, GPU_TILES = ..._split_store256, QUERY_GRAD_TILE BC 128):
# (1) the sync that a Python scalar at tensor indices makes, seen by torch's sync debug mode; (2) the whole loss A/B
# at B 65,536 with its fp64 check; (3) the GPU tests of the stored weights, 'auto' and the document blocks; (4) the
# curve 16,384-131,072 of the default against 1d51c95 (.prev), within CAP s in all (`bash call2.sh CAP`, default 570).
# Carry .whl .gpu .prev.
set -u
R0=$PWD; T0=$(date +%s); CAP=${1:-570}
el() { echo $(( $(date +%s) - T0 )); }
left() { local t=$(( $1 - $(el) )); [ $t -lt 5 ] && t=5; echo $t; }  # seconds until $1, at least 5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
ln -sfn $R0/gradcache_sparton/resources $R0/.prev/gradcache_sparton/resources  # the same files at 1d51c95
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton, transformers, sentence_transformers; print(torch.__version__, triton.__version__, transformers.__version__, sentence_transformers.__version__)"; } > $L 2>&1
python3 - >> $L 2>&1 <<'PY'
import torch
x, i = torch.zeros(1000, device="cuda"), torch.arange(10, device="cuda")
for name, value in [("python 0.0", 0.0), ("device zero", x.new_zeros(()))]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        x[i] = value
        print(f"sync check: {name} at tensor indices: no sync")
    except RuntimeError as e:
        print(f"sync check: {name} at tensor indices: {str(e).splitlines()[0]}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
PY
timeout $(left $CAP) python3 -m benchmarks.bench_loss_kernel --beir_path $R0/.gpu/data/scifact --batches 65536 --budget_s $(left $(( CAP - 20 ))) --output $OUT/ab_65536.json --variants window256_stored_hot1024_query,window256_stored_hot1024_query_split_store256 >> $L 2>&1; echo "ab rc=$? at $(el) s" | tee -a $L
timeout $(left $CAP) python3 -m pytest -q -p no:cacheprovider tests/test_fused_lse_gpu.py -k "query or matches_blocked or auto or never_wait" >> $L 2>&1; echo "gpu tests rc=$? at $(el) s" | tee -a $L
C="python3 -m benchmarks.bench_loss_curve --beir_path $R0/.gpu/data/scifact --kinds text --min_batch 16384 --max_batch 131072"
timeout $(left $(( CAP - 90 ))) $C --budget_s $(left $(( CAP - 100 ))) --out $OUT/curve_head.json >> $L 2>&1; echo "curve head rc=$? at $(el) s" | tee -a $L
(cd $R0/.prev && PYTHONPATH=$R0/.prev:/tmp/site timeout $(left $CAP) $C --budget_s $(left $(( CAP - 10 ))) --out $OUT/curve_1d51c95.json) >> $L 2>&1; echo "curve 1d51c95 rc=$? at $(el) s" | tee -a $L
grep -E "rc=|sync check|passed|failed|fused:|blocked |^ +[0-9]+ +text|Error|error" $L | cut -c1-400
