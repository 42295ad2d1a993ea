#!/bin/bash
# packed test, memory peak by site at the long history (both precisions), host cProfile of the MXFP8 step with graphs
source .whl/prelude.sh || exit 1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache PYTHONUNBUFFERED=1
python -c "import flash_attn.cute, quack" || { echo "NO CUTE STACK: stop"; exit 1; }
t0=$(date +%s)
timeout 100 python -m pytest -q -p no:cacheprovider tests/attention/test_producer.py -k packed > $OUT/packed.log 2>&1
echo "packed rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^E  .{0,300}" $OUT/packed.log | head -6
for p in mxfp8 bf16; do
timeout 120 python -m benchmarks.profile_saved trainer=gpu model=gem_$p data.history_mean=1024 trainer.progress=false trainer.cuda_graphs=false --top 14 --peak > $OUT/peak_$p.log 2>&1
echo "peak $p rc=$? at $(( $(date +%s) - t0 )) s"; grep -A16 "live at the traced" $OUT/peak_$p.log | cut -c1-120; tail -1 $OUT/peak_$p.log
done
timeout 120 python -m benchmarks.profile_train_step trainer=gpu model=gem_mxfp8 trainer.progress=false --warmup 15 --steps 8 --python > $OUT/py_mxfp8.log 2>&1
echo "py rc=$? at $(( $(date +%s) - t0 )) s"; tail -1 $OUT/py_mxfp8.log
