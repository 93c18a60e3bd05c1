"""Diagnostics: two gloo ranks on loopback: rank 0 sends MSG-byte messages to rank 1 at RATE bytes/s for DUR s
(the traffic of a pipeline's activations); used by stream_profile.sh. Throwaway diagnostics."""
import sys, time, torch, torch.distributed as dist
rank, port, dur, msg, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
a = torch.randn(msg // 4)
n = int(dur * rate / msg)
for i in range(n):
    if rank == 0:
        dist.send(a, 1); dist.recv(a, 1)
    else:
        dist.recv(a, 0); dist.send(a, 0)
    time.sleep(2 * msg / rate)
