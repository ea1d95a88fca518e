import sys, time, resource, random
import torch
from noria.models.catalog import model_path
from noria.service.adapters import MultiLora, AdapterSpec
from noria.service import step
from noria.service.wire import Datum
ck = sys.argv[1] == "1"; tenants = int(sys.argv[2]); budget = int(sys.argv[3])
torch.manual_seed(0)
chunk = int(sys.argv[4]) if len(sys.argv) > 4 else None
lora = MultiLora.load(str(model_path("smollm2-135m-instruct")), "float32", "cpu", checkpointing=ck, chunk_tokens=chunk)
assert (lora.chunked_head() is None) == (chunk is None)
names = []
for t in range(tenants):
    spec = AdapterSpec(rank=16, alpha=32.0, target_modules=("q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"), seed=t)
    a = lora.add(f"a{t}", "x", spec); names.append(a)
    with torch.no_grad():
        for n, p in a.params.items():
            if "lora_B" in n: p.normal_(0, 0.01)
rng = random.Random(0)
def data():
    out = []
    for _ in range(24):
        n = rng.randint(70, 100)
        toks = [rng.randint(10, 40000) for _ in range(n)]
        adv = torch.tensor([rng.uniform(-1, 1)] * n)
        out.append(Datum(tokens=toks, targets=torch.tensor(toks[1:] + [5]), inputs={"logprobs": torch.zeros(n), "advantages": adv}))
    return out
ds = [data() for _ in names]
times = []
for rep in range(3):
    calls = [step.Call(a, d, "importance_sampling", {}, True) for a, d in zip(names, ds)]
    t0 = time.perf_counter(); outs = step.run_calls(lora, calls, budget); times.append(time.perf_counter() - t0)
    assert all(e is None for _, e in outs), outs
g = [float(a.params[next(iter(a.params))].grad.norm()) for a in names]
lp = outs[0][0]["loss_fn_outputs"][0]["logprobs"]["data"][:3]
print(f"ckpt={ck} chunk={chunk} tenants={tenants} budget={budget} times={[round(x,2) for x in times]} maxrss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1e6:.2f} GB grad0={g[0]:.6e} lp={lp}")
