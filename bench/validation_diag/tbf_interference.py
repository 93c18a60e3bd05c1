#!/usr/bin/env python
"""Diagnostics: CPU time of a fixed matrix-multiply loop in an unrelated process, idle and while two
ranks stream 262 KB messages over a tc-tbf link (network namespaces, root):

    sudo PYTHONPATH=$PWD python bench/validation_diag/tbf_interference.py GBIT_S BURST_BYTES   # e.g. 0.2 3000
"""
import sys, subprocess, os, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from hgopt.profiler.run import emulated_pair, free_port
py = sys.executable
HERE = __import__("pathlib").Path(__file__).resolve().parent
port = free_port()
print(subprocess.run([py, str(HERE / "_burn.py"), "6", "idle"], capture_output=True, text=True).stdout.strip())
with emulated_pair(float(sys.argv[1]), tag=str(port), burst_bytes=int(sys.argv[2])) as (spaces, ifnames, addr):
    procs = [subprocess.Popen(["ip", "netns", "exec", spaces[r], "env", f"GLOO_SOCKET_IFNAME={ifnames[r]}",
                               py, str(HERE / "_stream.py"), str(r), addr, str(port), "12"], stderr=subprocess.DEVNULL) for r in range(2)]
    time.sleep(4)
    print(subprocess.run([py, str(HERE / "_burn.py"), "6", "during-netns-stream"], capture_output=True, text=True).stdout.strip())
    for p in procs: p.wait()
print(subprocess.run([py, str(HERE / "_burn.py"), "6", "idle"], capture_output=True, text=True).stdout.strip())
