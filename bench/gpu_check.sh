#!/usr/bin/env bash
# The device checks as one prepared script, for a CUDA machine (docs/scaling.md, "Devices and
# precision"): the `gpu`-marked tests of tests/test_devices.py (a bf16 train step, the engine's
# lossless check, the goodput policy's calibration and hot-swap, a checkpoint loaded back), then
# one train step at H = 4096 (`tidespec bench online` on the llama8b-width synthetic target: hidden
# states from disk against online rehydration, trainer tokens/s, MFU, peak GPU memory).
#
# Usage: OUT=<results dir> bash bench/gpu_check.sh. Python packages the machine lacks travel as
# wheels in .whl/ (installed into /tmp/site); the repository's src/ is put on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/gpu.txt"
timeout 180 python3 -m pytest -p no:cacheprovider -q -rs --durations=5 tests/test_devices.py 2>&1 | tee "$OUT/pytest-gpu.log"
# streamed (a buffer of ~4.7k prepared tokens: every epoch reads and prepares again), then held
for buf in 512 2048; do
  timeout $([ $buf = 512 ] && echo 260 || echo 150) python3 -m tidespec.cli bench online --target llama8b-width --device cuda --tokens "${TOKENS:-8192}" \
    --seq-len 1024 --passes $([ $buf = 512 ] && echo 2 || echo 1) --epochs 2 --buffer-mb $buf --draft-vocab-size 32000 --batch-tokens 4096 \
    --work /tmp/bench-online --out "$OUT/buffer-$buf" 2>&1 | tee "$OUT/bench-online-$buf.log"
done
