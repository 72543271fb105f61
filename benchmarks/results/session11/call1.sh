set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
timeout 120 python3 -m pytest tests/test_fused_lse_gpu.py -m gpu -v -p no:cacheprovider >> $L 2>&1; echo "gpu tests default rc=$? at $(el) s" | tee -a $L
X="python3 .gpu/explore/explore.py --new --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt --temperature 1.0 --ref /tmp/r1.pt"
echo "== E1 T=1" >> $L; timeout 200 $X --only new-max1024,new-split64,new-split128,new-qonly,new-donly,new-donly64 --budget_s 180 --output $OUT/e1_t1.json >> $L 2>&1; echo "e1 rc=$? at $(el) s" | tee -a $L
echo "== E2 T=1 stores, not atomics (wrong values: timing only)" >> $L; X_ATOMIC=0 timeout 100 $X --xnew --only new-max1024,new-donly64 --budget_s 80 --output $OUT/e2_t1_noatomic.json >> $L 2>&1; echo "e2 rc=$? at $(el) s" | tee -a $L
for V in split64 split128; do
timeout 90 python3 -c "
import sys, pytest
from gradcache_sparton.losses import fused_lse
fused_lse.GPU_TILES = fused_lse.VARIANTS['$V']
sys.exit(pytest.main(['tests/test_fused_lse_gpu.py', '-m', 'gpu', '-q', '-p', 'no:cacheprovider']))
" >> $L 2>&1; echo "gpu tests $V rc=$? at $(el) s" | tee -a $L
done
grep -E "^== | fwd |FAILED|Error|passed|failed" $L | tail -20
