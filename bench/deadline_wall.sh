#!/bin/bash
# Wall clock of `hgopt plan INSTANCE --json --time-limit T` for the issue #11 item 4 contract
# (max(1.1 T, T + 2 s)), whole process, /usr/bin/time -v. Usage: bench/deadline_wall.sh TREE TAG [OUTDIR]
# (TREE: a checkout whose hgopt is imported; each run's JSON and time -v output go to OUTDIR).
tree=$1; tag=$2; out=${3:-/tmp/deadline_wall}; py=${PYTHON:-/work/main/.venv/bin/python}
mkdir -p "$out"; cd "$tree" || exit 2
for T in 10 30; do for I in geo-3r-gpt1.3b default sailor-geo-5x32; do
  up=$(uptime | sed 's/.*load average: //')
  PYTHONPATH=$tree /usr/bin/time -v "$py" -m hgopt plan $I --json --time-limit $T > "$out/$tag-$I-$T.json" 2> "$out/$tag-$I-$T.err"
  w=$(grep "Elapsed (wall" "$out/$tag-$I-$T.err" | awk '{print $NF}'); r=$(grep "Maximum resident" "$out/$tag-$I-$T.err" | awk '{print $NF}')
  s=$("$py" -c "import json;d=json.load(open('$out/$tag-$I-$T.json'));print(d['status'],round(d['search_time_s'],1),d['iteration_time_s'],d['lower_bound_s'],d.get('skipped'))" 2>&1 | tail -1)
  echo "$tag $I T=$T wall=$w rss_kb=$r load=[$up] $s"
done; done
