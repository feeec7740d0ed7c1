import time, torch, torch.nn.functional as F
torch.set_num_threads(1)
V, H, S = 49152, 576, 128
w = torch.randn(V, H, requires_grad=True)
ids = torch.randint(0, V, (1, S)); g = torch.randn(1, S, H)
def t(f, n=8):
    f(); ts=[]
    for _ in range(5):
        t0=time.perf_counter()
        for _ in range(n): f()
        ts.append(time.perf_counter()-t0)
    return sorted(ts)[2]
acc = torch.zeros(V, H)
print("zeros x8 %.3f" % t(lambda: torch.zeros(V, H)))
print("add x8 %.3f" % t(lambda: acc.add_(acc)))
print("dense_backward op x8 %.3f" % t(lambda: torch.ops.aten.embedding_dense_backward(g, ids, V, -1, False)))
print("zeros+index_add x8 %.3f" % t(lambda: torch.zeros(V, H).index_add_(0, ids.flatten(), g.reshape(-1, H))))
print("index_add into acc x8 %.3f" % t(lambda: acc.index_add_(0, ids.flatten(), g.reshape(-1, H))))
