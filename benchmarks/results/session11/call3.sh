set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$R0:/tmp/site
L=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $L 2>&1
X="python3 .gpu/explore/explore.py --new --beir_path $R0/.gpu/data/scifact --reps_cache /tmp/reps.pt"
A=new-max1024,s128-bd4352,s128-bd2176,s128-bd1024,s128-bd512,s128-bd256,columns-bd512
echo "== T=1" >> $L; timeout 200 $X --only $A --temperature 1.0 --budget_s 170 --output $OUT/bd_t1.json >> $L 2>&1; echo "t1 rc=$? at $(el) s" | tee -a $L
echo "== T=0.05" >> $L; timeout 110 $X --only new-max1024,s128-bd4352,s128-bd1024,s128-bd512,s128-bd256 --temperature 0.05 --budget_s 90 --output $OUT/bd_t005.json >> $L 2>&1; echo "t005 rc=$? at $(el) s" | tee -a $L
grep -E 'fwd|rc=|Error' $L | cut -c1-300
