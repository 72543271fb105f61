set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
M="python3 .gpu/s11/micro.py --reps_cache /tmp/reps.pt --beir_path $R0/.gpu/data/scifact"
S="s128s2:stages=2;s128s4:stages=4;s128bk32:bk=32;s128w8:warps=8;s256w8:bn_backward=256,bn_scan=256,warps=8;m128:bm=128,warps=8,bn_backward=64;m128b128:bm=128,warps=8;c128:bn_backward=128,dense_split=0"
echo "== micro sweep T=1" >> $L; timeout 240 $M --shapes "$S" --output $OUT/micro_t1.json >> $L 2>&1; echo "micro rc=$? at $(el) s" | tee -a $L
export PICK_SHAPE=$(python3 -c "
import json; r=[x for x in json.load(open('$OUT/micro_t1.json'))['results'] if 'backward_both_s' in x]
print(json.dumps(min(r, key=lambda x: x['backward_both_s'])['shape']))")
echo "pick: $PICK_SHAPE" | tee -a $L
X="python3 .gpu/explore/explore.py --new --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt"
echo "== E T=1" >> $L; timeout 130 $X --only new-max1024,new-split128,new-pick --temperature 1.0 --budget_s 110 --output $OUT/e_t1.json >> $L 2>&1; echo "e t1 rc=$? at $(el) s" | tee -a $L
echo "== E T=0.05" >> $L; timeout 130 $X --only new-max1024,new-split128,new-pick --temperature 0.05 --budget_s 110 --output $OUT/e_t005.json >> $L 2>&1; echo "e t005 rc=$? at $(el) s" | tee -a $L
echo "== ncu" >> $L
timeout 150 ncu --clock-control none -k regex:"_forward_kernel|_dense_kernel" -c 16 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page details $M --reps 1 --only columns,split128 > $OUT/ncu.csv 2>> $L; echo "ncu rc=$? at $(el) s" | tee -a $L
grep -E 'pick|fwd|"name"|Error|rc=' $L | cut -c1-600
