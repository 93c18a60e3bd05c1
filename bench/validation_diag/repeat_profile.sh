#!/bin/bash
# Diagnostics: the 4-tenant paced profile at mbs 4 repeated N times back to back, as the validation bench
# runs it; prints the load and the block's / all layers' device seconds per run.
#   sudo env N=4 PY=/work/main/.venv/bin/python bench/validation_diag/repeat_profile.sh        (from the repo root)
PY=${PY:-python}; export PYTHONPATH=$PWD
for i in $(seq 1 ${N:-4}); do
  l=$(cut -d' ' -f1 /proc/loadavg)
  HGOPT_PACE_RT=1 $PY -m hgopt.cli profile --tenants ${T:-4} --blocks 4 --hidden 128 --heads 4 --vocab 256 --seq 128 \
      --mbs 4 --pace 0.15 --warmup 2 --repeat 15 -o /tmp/repeat_profile.json >/dev/null 2>&1
  $PY -c "
import json;t=json.load(open('/tmp/repeat_profile.json'))['timings'][0]
print('load $l', 'blk fwd %.4f bwd %.4f'%(t['fwd'][1],t['bwd'][1]), 'all %.4f'%(sum(t['fwd'])+sum(t['bwd'])))"
done
