#!/bin/bash
# The validation bench in two halves of ~8 minutes each (the 8 lan/w200 plans, then the 6 others), so that
# each run stays under 10 minutes on a shared 2-core host; the w200 candidates stay together (Kendall tau).
#   sudo env PY=/work/main/.venv/bin/python bench/validation_diag/validate_halves.sh /tmp/v3/r3 [ARGS...]   (from the repo root)
# writes OUT-a/ and OUT-b/ (table.md, rows.json, runs/) and prints the load at each half's start and end.
PY=${PY:-python}; export PYTHONPATH=$PWD
OUT=$1; shift
A="lan 2st m4,lan 4st m4,w200 2st a|b m4,w200 4st aa|bb m4,w200 2st a|b mbs2 m8,w200 2st aa m4,w200 dp a+b,w200 2st dp2 a|b"
B="lan 2st uneven m4,w50 2st a|b m4,w50 2st a|b bf16 m4,w50 3st a|a|b gpipe,w1000+20ms 4st aa|bb,w100+50ms 2st a|b m4,w100+50ms 3st a|b|b m8"
for h in a b; do
  if [ $h = a ]; then O="$A"; else O="$B"; fi
  echo "half $h start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  $PY bench/validate_cost_model.py --out "$OUT-$h" --only "$O" --png "$OUT-$h.png" "$@" > "$OUT-$h.log" 2>&1
  echo "half $h end $(date -u +%T) rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
done
