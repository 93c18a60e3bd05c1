import time, torch, sys, statistics
torch.set_num_threads(1)
a = torch.randn(256, 512); b = torch.randn(512, 512)
dur = float(sys.argv[1]); out = []
t_end = time.perf_counter() + dur
while time.perf_counter() < t_end:
    c = time.thread_time()
    for _ in range(20): a @ b
    out.append(time.thread_time() - c)
    time.sleep(0.02)
print(sys.argv[2], "median cpu per chunk ms", round(statistics.median(out)*1e3, 3), "n", len(out))
