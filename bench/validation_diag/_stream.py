import os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1]); addr = sys.argv[2]; port = int(sys.argv[3]); dur = float(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
n = 262144 // 4; a = torch.randn(n)
t_end = time.time() + dur
cnt = 0
while True:
    flag = torch.tensor([1.0 if time.time() < t_end else 0.0]); dist.broadcast(flag, 0)
    if flag.item() == 0: break
    if rank == 0: dist.send(a, 1)
    else: dist.recv(a, 0)
    cnt += 1
print("messages", cnt)
