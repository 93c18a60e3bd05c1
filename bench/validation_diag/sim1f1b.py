#!/usr/bin/env python
"""Diagnostics: strict 1F1B replay (no links, one optimizer step at the end) of a traced run's own per-op
device times (bench/_op_trace.py via trace_ops.py): does composing the run's measured stage times reproduce
its measured step?   python bench/validation_diag/sim1f1b.py /tmp/trace/lan_4st_m4
Throwaway diagnostics, not a benchmark."""
import json,statistics,sys,glob
def order(S,s,m):
    w=min(S-s,m); o=[('F',k) for k in range(w)]; f=w; b=0
    while b<m:
        o.append(('B',b)); b+=1
        if f<m: o.append(('F',f)); f+=1
    return o
def sim(F,B,m,c=0.0):
    S=len(F); done={}; t=[0.0]*S; idx=[0]*S; ords=[order(S,s,m) for s in range(S)]
    prog=True
    while prog:
        prog=False
        for s in range(S):
            while idx[s]<len(ords[s]):
                kind,k=ords[s][idx[s]]
                if kind=='F': dep=None if s==0 else ('F',s-1,k)
                else: dep=('F',s,k) if s==S-1 else ('B',s+1,k)
                if dep is not None and dep not in done: break
                st=max(t[s], (done[dep]+(c if dep[1]!=s else 0)) if dep else 0)
                t[s]=st+(F[s] if kind=='F' else B[s]); done[(kind,s,k)]=t[s]; idx[s]+=1; prog=True
    return max(t)
if __name__=='__main__':
    folder=sys.argv[1]; pace=0.15
    F=[];B=[];O=[]
    tr={}
    for f in glob.glob(folder+'/trace/ops-*.json'):
        st=json.load(open(f))
        if st: tr[st[0]['stage']]=st[3:]
    for s in sorted(tr):
        st=tr[s]
        F.append(statistics.median(o['model_fwd'] for x in st for o in x['ops'] if o['kind']=='F')/pace)
        B.append(statistics.median(o['backward'] for x in st for o in x['ops'] if o['kind']=='B')/pace)
        O.append(statistics.median(x['opt'] for x in st)/pace)
    print('F',[round(x,4) for x in F],'B',[round(x,4) for x in B],'opt',[round(x,4) for x in O])
    for c in (0,0.001,0.002):
        print('c',c,'1f1b',round(sim(F,B,4,c)+max(O),4))
