"""Training-state memory from the precision policy (autopar.cost.precision), never from
the dtype of an op in the graph.

Per model family (zoo GPT, LLaMA, BERT, ViT, and transformers' LlamaForCausalLM built on
meta; four blocks, two traced): mixed-precision AdamW holds 16 bytes per parameter, 2 + 2
+ 4 + 8, divided exactly as each ZeRO stage shards it over data-parallel, 1D tensor-
parallel and pipeline layouts, on every pipeline rank of the plan's report; fp32 holds
4 + 4 + 0 + 8, what `parallelize` holds (fp32 masters under precision="bf16"); the free
and --executable searches price the same bytes. Offload counts against the profile's host memory, in
the search and in `--min-devices`.
"""

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.cost.hardware import load_hardware
from autopar.cost.precision import mixed, precision_of, runtime
from autopar.cost.state import state_bytes
from autopar.errors import PlanError
from autopar.models import build, workload
from autopar.modes import RUNTIME
from autopar.report.predicted import plan_text
from autopar.search import planner
from autopar.search.search import Constraints, Options, Search, SearchResult
from autopar.sharding.solve import solve
from autopar.world import World

SPECS = {"gpt": "gpt:layers=4,hidden=64,heads=8,vocab=256,seq=32",
         "llama": "llama:layers=4,hidden=64,heads=8,kv_heads=4,ffn=192,vocab=256,seq=32",
         "bert": "bert:layers=4,hidden=64,heads=8,intermediate=256,vocab=256,seq=32",
         "vit": "vit:layers=4,hidden=64,heads=8,mlp=256,image=32,patch=8,classes=16"}
FAMILIES = (*SPECS, "transformers-llama")
BATCH = 8
WORLD = World(4, per_node=4, device="a100-80gb")


def _hf_llama(dtype: torch.dtype):
    """transformers' LlamaForCausalLM from a small config on meta, two of four blocks
    traced (as the zoo's workloads trace two)."""
    transformers = pytest.importorskip("transformers")

    def make(layers: int):
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192,
                                       num_hidden_layers=layers, num_attention_heads=8,
                                       num_key_value_heads=4, max_position_embeddings=64)
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).to(dtype)

    x = torch.zeros(2, 32, dtype=torch.long, device="meta")

    def loss_fn(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())

    count = sum(p.numel() for p in make(4).parameters())
    return make(2), (x,), loss_fn, x.clone(), (2, 4), count


@functools.lru_cache(maxsize=None)
def _chain(family: str, dtype: torch.dtype):
    """(layer chain with tp 2 priced, parameter count of the whole model)."""
    if family == "transformers-llama":
        model, inputs, loss_fn, target, layers, count = _hf_llama(dtype)
    else:
        w = workload(SPECS[family], batch=2, dtype=dtype)
        model, inputs, loss_fn, target = w.model, w.inputs, w.loss_fn, w.target
        layers = (w.traced_layers, w.layers)
        whole, _ = build(SPECS[family], batch=2, device="meta", dtype=dtype)
        count = sum(p.numel() for p in whole.parameters())
    chain = planner.prepare(model, inputs, loss_fn=loss_fn, example_target=target,
                            tp_sizes=(2,), layers=layers)
    return chain, count


def _plan(chain, constraints: dict, dtype: str, executable: bool = False):
    """The first candidate under `constraints`, made into a Plan with the report's per-rank
    memory (every pipeline rank repriced by report.py)."""
    options = Options(global_batch=BATCH, dtype=dtype,
                      executable=RUNTIME if executable else None)
    search = Search(chain, WORLD, options, Constraints(offload=False, **constraints))
    cand = search.every()[0]
    result = SearchResult(cand, [], 1, 0.0, precision=search.precision)
    return planner.to_plan(chain, WORLD, result, BATCH, dtype, 0.0), cand


def _per_rank_elements(chain, plan) -> list[float]:
    """Parameter elements each pipeline rank holds: numel of each parameter of the layers on
    it (each counted in the first layer that reads it), split as the catalog's 1D layouts
    split it, untraced blocks counted as the traced one they repeat."""
    tp = plan.mesh["tp"]
    layouts = solve(chain.traced, axis="tp", size=tp).params if tp > 1 else {}
    per_layer, seen = {}, set()
    for layer in chain.traced.layers:
        per_layer[layer.name] = 0.0
        for node in layer.nodes:
            p = chain.traced.params.get(node.target) if node.op == "get_attr" else None
            if p is None or not p.is_parameter or p.names in seen:
                continue
            seen.add(p.names)
            layout = layouts.get(node.target)
            parts = layout.parts({"tp": tp}) if layout is not None else 1
            per_layer[layer.name] += math.prod(p.shape) / parts
    out = [0.0] * plan.mesh["pp"]
    for layer, source in zip(plan.layers, chain.sources):
        out[layer.stage] += per_layer[source]
    return out


def _expect(precision, elements: float, replicas: int, zero: int) -> dict:
    return {"parameters": precision.weights * elements / (replicas if zero == 3 else 1),
            "gradients": precision.gradients * elements / (replicas if zero >= 2 else 1),
            "optimizer": (precision.master + precision.optimizer) * elements
            / (replicas if zero else 1)}


LAYOUTS = {"dp 4": dict(dp=4), "tp 2 x dp 2": dict(tp=2, dp=2),
           "pp 2 x dp 2": dict(pp=2, dp=2, schedule="1f1b")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,name,per_param", [(torch.bfloat16, "bf16", (2, 2, 4, 8)),
                                                  (torch.float32, "fp32", (4, 4, 0, 8))])
def test_adamw_state_is_16_bytes_a_parameter_divided_as_zero_shards_it(family, dtype, name,
                                                                       per_param):
    chain, count = _chain(family, dtype)
    assert chain.params == count  # from the parameters, the untraced blocks included
    precision = precision_of(chain.param_dtype)
    assert (precision.weights, precision.gradients, precision.master,
            precision.optimizer) == per_param and precision.total == 16
    for layout, fixed in LAYOUTS.items():
        for zero in range(4):
            plan, cand = _plan(chain, dict(fixed, zero=zero), name)
            replicas = plan.mesh["dp"] * plan.mesh["cp"]
            ranks = plan.detail["ranks"]
            elements = _per_rank_elements(chain, plan)
            assert len(ranks) == len(elements) == plan.mesh["pp"]
            for rank, e in zip(ranks, elements):
                want = _expect(precision, e, replicas, zero)
                got = {k: rank["memory_bytes"][k] for k in want}
                assert got == pytest.approx(want, rel=1e-9, abs=1), (layout, zero, rank["rank"])
            if zero == 0 and plan.mesh["pp"] == 1 and plan.mesh["tp"] == 1:
                held = sum(cand.memory[k] for k in ("parameters", "gradients", "optimizer"))
                assert held == pytest.approx(16 * count, rel=1e-12)


def test_an_fp32_op_in_the_graph_does_not_change_the_state_bytes():
    chain, count = _chain("llama", torch.bfloat16)
    assert chain.dtype_bytes == 4  # RMSNorm and RoPE run in fp32 in the traced graph
    assert chain.param_dtype == torch.bfloat16
    plan, cand = _plan(chain, dict(dp=4, zero=0), "bf16")
    assert cand.memory["optimizer"] == pytest.approx(12 * count, rel=1e-12)
    text = plan_text(plan.detail)
    assert "16 B/parameter = weights 2 + gradients 2 + fp32 master 4 + moments 8" in text


def test_state_bytes_counts_what_the_runtimes_adamw_holds():
    """`state_bytes` applies torch's AdamW per tensor (checked against a real step in
    test_memory.py): fp32 parameters (what precision="bf16" trains: fp32 masters) hold
    4 + 4 + 8; bf16 parameters 2 + 2 and an fp32 master and moments, 4 + 8
    (autopar.runtime.master; tests/test_precision_master.py measures it)."""
    for dtype, per_param in ((torch.float32, (4, 4, 0, 8)), (torch.bfloat16, (2, 2, 4, 8))):
        chain, count = _chain("gpt", dtype)
        held = state_bytes(chain.traced)
        n_tensors = sum(1 for p in chain.traced.params.values() if p.is_parameter)
        moments = (held.optimizer - 4 * n_tensors) / held.parameters  # less AdamW's `step`
        assert held.gradients / held.parameters == per_param[1] / per_param[0]
        assert moments == (per_param[2] + per_param[3]) / per_param[0]
    assert runtime(torch.bfloat16).total == mixed(torch.bfloat16).total == 16


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_the_free_and_executable_searches_price_the_same_state_bytes(dtype, name):
    """One precision policy: the same layout, dtype and ZeRO stage cost the same state bytes
    with and without --executable, to the byte, on every rank."""
    chain, count = _chain("gpt", dtype)
    for zero in range(4):
        free, free_cand = _plan(chain, dict(dp=4, zero=zero), name)
        runs, runs_cand = _plan(chain, dict(dp=4, zero=zero), name, executable=True)
        assert free.mesh == runs.mesh
        assert free.search["precision"] == runs.search["precision"]
        for a, b in zip(free.detail["ranks"], runs.detail["ranks"]):
            assert {k: a["memory_bytes"][k] for k in ("parameters", "gradients", "optimizer")} \
                == {k: b["memory_bytes"][k] for k in ("parameters", "gradients", "optimizer")}
        assert {k: free_cand.memory[k] for k in ("parameters", "gradients", "optimizer")} == \
            {k: runs_cand.memory[k] for k in ("parameters", "gradients", "optimizer")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_priced_state_is_what_parallelize_holds(precision):
    """An fp32 model planned in `precision` and run by `parallelize` with it: the plan's
    parameter, gradient and optimizer bytes are what the engine holds after a step (less
    AdamW's step counters, 4 bytes a tensor), with and without --executable."""
    import autopar
    from autopar.runtime.measure import measure_state_bytes

    spec = SPECS["gpt"]
    model, (x,) = build(spec, batch=BATCH, device="cpu", seed=0)
    y = torch.randint(0, 256, x.shape)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))

    world = World(1, per_node=1, device="a100-80gb")
    priced = []
    for executable in (False, True):
        plan = autopar.plan(model, (x,), world, global_batch=BATCH, loss_fn=loss_fn,
                            example_target=y, dtype=precision, executable=executable,
                            constraints=dict(zero=0, recompute="none"))
        mem = plan.predicted["memory_breakdown_bytes"]
        priced.append({k: mem[k] for k in ("parameters", "gradients", "optimizer")})
    assert priced[0] == priced[1]
    engine = autopar.parallelize(model, 1, example_inputs=(x[:2],), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 precision=precision, plan=dict(recompute="none"))
    held = measure_state_bytes(engine, lambda: engine.train_step(x, y))
    n_tensors = sum(1 for _ in engine.parameters())
    assert priced[0] == {"parameters": held.parameters, "gradients": held.gradients,
                         "optimizer": held.optimizer - 4 * n_tensors}


def _profile_with_host(tmp_path, host_bytes: int) -> str:
    data = load_hardware("a100-80gb").to_json()
    data["host_memory_bytes"] = host_bytes
    path = tmp_path / f"host-{host_bytes}.json"  # profiles load once per path
    path.write_text(json.dumps(data))
    return str(path)


def test_offload_counts_against_the_hosts_memory(tmp_path):
    chain, count = _chain("gpt", torch.bfloat16)
    offloaded = count * (4 + 8 + 2) / 4  # ZeRO-1 shard of master, moments and gradient
    for host, fits in ((4 * offloaded * 1.01, True), (4 * offloaded * 0.99, False)):
        world = World(4, per_node=4, device=_profile_with_host(tmp_path, int(host)))
        search = Search(chain, world, Options(global_batch=BATCH, dtype="bf16"),
                        Constraints(dp=4, zero=1, offload=True))
        cands = search.every()
        assert cands and all(c.host_per_device == pytest.approx(offloaded) for c in cands)
        assert all(c.optimizer_s > 0 and c.memory["optimizer"] == 0 for c in cands)
        assert all(c.fits is fits for c in cands)
        if not fits:
            assert "host memory short" in search.reason(cands[0], None)
            with pytest.raises(PlanError, match="offloads .* to the host"):
                planner.to_plan(chain, world, search.run(), BATCH, "bf16", 0.0)
        else:
            plan = planner.to_plan(chain, world, search.run(), BATCH, "bf16", 0.0)
            text = plan_text(plan.detail)
            assert "offloaded per device (14 B/parameter of its shard)" in text
            assert plan.predicted["host_memory_per_device_bytes"] == int(offloaded)


def test_reference_profiles_state_their_host_memory():
    for name, tib in (("a100-40gb", 1), ("a100-80gb", 2), ("h100-80gb", 2), ("h200", 2)):
        hw = load_hardware(name)
        assert hw.host_memory_bytes == tib * 1024 ** 4
        assert "host memory" in hw.source


def test_min_devices_counts_offload_against_the_hosts_memory(tmp_path, capsys):
    """On a device too small for the state, offload cuts the fewest devices only when the
    hosts can take what it moves there (8 to 2: without offload the foreach AdamW step's fp32
    copy of the moments' shard also needs room on the device)."""
    from autopar.cli import main

    answers = {}
    for host in (1, 10 ** 12):
        data = load_hardware("a100-80gb").to_json()
        data.update(memory_bytes=1_000_000, host_memory_bytes=host)
        path = tmp_path / f"small-{host}.json"
        path.write_text(json.dumps(data))
        assert main(["explain", SPECS["gpt"], "--world", "8", "--batch", "8", "--device",
                     str(path), "--min-devices", "--format", "json"]) == 0
        out = json.loads(capsys.readouterr().out)
        answers[host] = (out["min_devices"]["devices"], out["zero"]["offload"])
    assert answers == {1: (8, False), 10 ** 12: (2, True)}


def test_one_formula_prices_the_flat_buffers():
    """The biggest layer's flat buffers (twice for the sync between replicas, twice more for
    ZeRO-3's gathers) are one cost formula, which the memory by kind and the search's
    memory-balanced stage split both read."""
    import numpy as np

    from autopar.cost.step import buffer_bytes, memory_by_kind

    assert [buffer_bytes(10.0, r, z) for r, z in [(1, 0), (2, 0), (1, 3), (4, 3)]] == \
        [0.0, 20.0, 20.0, 40.0]
    parts = memory_by_kind(np.array([100.0]), np.zeros(1), 10.0, 4, 3, False, np.ones(1),
                           mixed(torch.bfloat16), workspace=5.0)
    assert parts["buffers"][0] == buffer_bytes(10.0, 4, 3) + 5.0
    import inspect

    from autopar.cost.step import stage_memory

    assert "buffer_bytes(biggest, replicas, zero)" in inspect.getsource(stage_memory)
    search_source = (Path(planner.__file__).parent / "search.py").read_text()
    assert "stage_memory(" in search_source
