import sys, torch, fusednorm
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[1]]
op, M, N = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
r = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
w = torch.randn(N, device="cuda", dtype=dtype, generator=g)
b = torch.randn(N, device="cuda", dtype=dtype, generator=g)
for _ in range(3):
    if op == "ln":
        fusednorm.layer_norm(x, (N,), w, b)
    else:
        fusednorm.add_layer_norm(x, r, (N,), w, b)
torch.cuda.synchronize()
