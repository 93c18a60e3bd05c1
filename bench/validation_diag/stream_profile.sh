#!/bin/bash
# Diagnostics: the 4-tenant paced profile at mbs 4 alone, then while two gloo ranks exchange 1 MB messages
# over loopback at RATE bytes/s (a pipeline's activation traffic; _lostream.py), twice.
#   sudo env PY=/work/main/.venv/bin/python bench/validation_diag/stream_profile.sh         (from the repo root)
PY=${PY:-python}; export PYTHONPATH=$PWD
prof() {
  HGOPT_PACE_RT=1 $PY -m hgopt.cli profile --tenants 4 --blocks 4 --hidden 128 --heads 4 --vocab 256 --seq 128 \
      --mbs 4 --pace 0.15 --warmup 2 --repeat 15 -o /tmp/stream_profile.json >/dev/null 2>&1
  $PY -c "
import json;t=json.load(open('/tmp/stream_profile.json'))['timings'][0]
print('$1 load $(cut -d' ' -f1 /proc/loadavg)', 'blk fwd %.4f bwd %.4f'%(t['fwd'][1],t['bwd'][1]), 'all %.4f'%(sum(t['fwd'])+sum(t['bwd'])))"
}
for i in 1 2; do
  prof alone
  for p in 0 1; do $PY bench/validation_diag/_lostream.py $p 29$((400+i)) 25 1048576 ${RATE:-50e6} & done
  sleep 3; prof stream; wait
done
