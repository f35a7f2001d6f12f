#!/bin/bash
# The GPU checks of 2026-11-27 (issue 46's session), in one call on a lent machine:
#   bash benchmarks/results/gpu-2026-11-27/run.sh DIR
# CUDA tests, then gpu_overlap.py's every peer at both presets (rounds cut to fit the lease).
D=${1:-$OUT}; export PYTHONPATH=$PWD
nvidia-smi -L > $D/gpu.txt; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" >> $D/gpu.txt
step() { local name=$1; shift; local t=$(date +%s); "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t )) s" >> $D/times.txt; }
step cuda_tests timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_collectives.py tests/test_memory.py tests/test_outer_bits.py tests/test_overlap.py -k cuda
step ws1_small python3 benchmarks/gpu_overlap.py --world-sizes 1 --models small --no-report --out $D/gpu_ws1_small.json
step ws2_small python3 benchmarks/gpu_overlap.py --world-sizes 2 --models small --rounds 10 --no-report --out $D/gpu_ws2_small.json
step ws1_large python3 benchmarks/gpu_overlap.py --world-sizes 1 --models large --rounds 4 --no-report --out $D/gpu_ws1_large.json
step ws2_large python3 benchmarks/gpu_overlap.py --world-sizes 2 --models large --rounds 2 --methods roofline ddp-zero1 acco-sync acco acco-aww --no-report --out $D/gpu_ws2_large.json
