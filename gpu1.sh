#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
( time timeout 200 python3 -m pytest -m cuda -q -n 8 -rA -p no:cacheprovider tests/test_quant_model.py tests/test_gpu_kernels.py -k "cuda and (hc_mix or quant_model or slots or shared)" ) > $OUT/tests.txt 2>&1
tail -15 $OUT/tests.txt
PYTHON=python3 timeout 370 bash benchmarks/seed_protocol.sh h200-q4km48-slmix $OUT/r > $OUT/slmix.log 2>&1
tail -30 $OUT/slmix.log
