set -u
R0=$PWD; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$R0:/tmp/site TOKENIZERS_PARALLELISM=true
L=$OUT/summary.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; git log -1 --format=%H 2>/dev/null; date -u; } > $L 2>&1
D=$R0/.gpu/data/scifact
GS="python3 -m gradcache_sparton.cli"
T='--model_name_or_path splade-tiny-msmarco --query_max_length 32 --document_max_length 256 --weight_decay 0.01 --bf16 True --learning_rate 2e-4 --query_reg_weight 5e-4 --doc_reg_weight 3e-4 --mini_batch_size 256 --max_steps 50 --warmup_steps 5 --dataloader_num_workers 2 --per_device_train_batch_size 2048'
R='--query_max_length 32 --document_max_length 256 --weight_decay 0.01 --bf16 True --learning_rate 2e-4 --query_reg_weight 5e-4 --doc_reg_weight 3e-4 --mini_batch_size 256 --max_steps 50 --warmup_steps 5 --dataloader_num_workers 2 --per_device_train_batch_size 1024 --contrastive kl_div --kl_in_batch True'
C="--beir_path $D --folds 5 --run_folds 4 --self_supervised_pairs 4000 --bm25_negatives 3 --teacher fold --teacher_normalisation minmax --resamples 2000"
$GS idf --model_name_or_path splade-tiny-msmarco --beir_path $D --output_dir /tmp/idf > /tmp/idf.log 2>&1 || { tail -20 /tmp/idf.log >> $L; }
$GS crossval $C --output_dir /tmp/f4s --seeds 42 1 --teacher_recipe="$T" -- --model_name_or_path splade-tiny-msmarco $R > /tmp/f4s.log 2>&1 &
P1=$!
$GS crossval $C --output_dir /tmp/f4l --seeds 42 --teacher_recipe="$T" -- --model_name_or_path /tmp/idf --query_encoder learned_idf $R > /tmp/f4l.log 2>&1 &
P2=$!
# the docs pages the last suite runs did not reach, at low CPU priority
( nice -n 15 timeout 500 python3 -m pytest -m gpu -n 3 -v -ra -p no:cacheprovider -k "test_docs_on_gpu and (distillation or engine or training)" tests/test_docs.py > $OUT/docs_gpu.txt 2>&1; echo "docs rc=$? at $(el) s" >> $OUT/docs_gpu.txt ) &
while [ $(el) -lt 570 ]; do
  n=0; for p in $P1 $P2; do kill -0 $p 2>/dev/null && n=$((n+1)); done
  [ $n -eq 0 ] && break; sleep 5
done
echo "crossval done or stopped at $(el) s" >> $L
for j in f4s f4l; do [ -f /tmp/$j/crossval.json ] && cp /tmp/$j/crossval.json $OUT/$j.crossval.json; { echo "== $j"; grep -vE "it/s\]|s/it\]" /tmp/$j.log | tail -c 30000; } >> $OUT/logs.txt; echo "== $j"; grep -E "fold [0-9]|nDCG|Error|error|Traceback" /tmp/$j.log | tail -8; done
cat $L
sleep 1; grep -E "PASSED|FAILED|ERROR|rc=" $OUT/docs_gpu.txt | tail -12
