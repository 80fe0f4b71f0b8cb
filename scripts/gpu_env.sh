#!/usr/bin/env bash
# The GPU machine a gpu_check run ran on (docs/results/gpu-env.txt): date, the GPU and its driver, the Python
# stack, the host CPU. Run on the device machine before `python3 scripts/gpu_check.py`.
date -u
nvidia-smi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
nproc
lscpu | grep -i 'model name'
