"""Shared check for the multi-process tests: a parallel run against the single-device run.

`compare` runs on every rank of a pool: it builds the model from a seed, trains it with
autopar under a plan and, in the same process, trains an identical copy on one device;
it returns the largest relative differences and the predicted and measured bytes.

AdamW runs with eps=1e-5: some parameters have a gradient that is exactly zero in exact
arithmetic (the key slice of a fused QKV bias: softmax ignores a constant added to every
score), so both runs feed Adam rounding noise, which the default eps=1e-8 would turn into
full-size steps in random directions. A larger eps leaves real gradients' steps as they
are and keeps the comparison about the parallelisation, not about that noise.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

MODELS = ("gpt-tiny", "llama-tiny", "bert-tiny", "vit-tiny", "mlp-tiny", "hf-gpt2", "hf-bert")


def _lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _cls_loss(out, target):
    return F.cross_entropy(out, target)


def build(name: str, batch: int, seed: int = 0):
    """(model, inputs, targets, loss_fn) on the CPU, identical for a given seed. `name`: a
    model name, or a module-level function of the batch returning that tuple."""
    torch.manual_seed(seed)
    if callable(name):
        return name(batch)
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
        x = torch.randint(0, 64, (batch, 8))
        return model, (x,), torch.randint(0, 64, (batch, 8)), _lm_loss
    if name == "hf-bert":
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=16,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = BertForMaskedLM(cfg)
        x = torch.randint(0, 64, (batch, 8))
        return model, (x,), torch.randint(0, 64, (batch, 8)), _lm_loss
    if name in ("hf-falcon", "hf-falcon-mq"):  # its linears compute x @ w.T
        from transformers import FalconConfig, FalconForCausalLM

        new = name == "hf-falcon"
        cfg = FalconConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
                           num_hidden_layers=2, new_decoder_architecture=new, multi_query=not new,
                           num_kv_heads=2 if new else None, hidden_dropout=0.0,
                           attention_dropout=0.0)
        model = FalconForCausalLM(cfg)
        x = torch.randint(0, 64, (batch, 8))
        return model, (x,), torch.randint(0, 64, (batch, 8)), _lm_loss
    if name in ("hand-lm", "opaque-lm"):  # test_linear_forms: linears written out by hand
        from test_linear_forms import HandLM, OpaqueLM

        model = HandLM() if name == "hand-lm" else OpaqueLM()
        return model, (torch.randint(0, 64, (batch, 8)),), torch.randint(0, 64, (batch, 8)), \
            _lm_loss
    from autopar.models import build as zoo_build

    model, (x,) = zoo_build(name, batch=batch, device="cpu", seed=seed)
    if not x.dtype.is_floating_point:  # token ids below the first embedding's size
        vocab = next((m.num_embeddings for m in model.modules()
                      if isinstance(m, torch.nn.Embedding)), int(x.max()) + 2)
        x = torch.randint(0, min(int(x.max()) + 2, vocab), x.shape)
    if x.dtype.is_floating_point:
        x = torch.randn(x.shape)
    with torch.no_grad():
        out = model(x)
    if out.dim() == 2:
        return model, (x,), torch.randint(0, out.shape[-1], (batch,)), _cls_loss
    return model, (x,), torch.randint(0, out.shape[-1], x.shape), _lm_loss


def assert_equal_to_one_device(results: list[dict], tol: float = 1e-4) -> None:
    """Every rank's `compare` result: losses and weights within `tol` of one device, the
    same state keys, and the collectives' bytes as `engine.predicted_comm` says."""
    for r in results:
        assert r["loss"] <= tol, r["loss"]
        assert r["weights"] <= tol, r["weights"]
        assert r["keys_equal"]
        assert r["measured"] == r["predicted"], (r["measured"], r["predicted"])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(name: str, plan, steps: int = 5, batch: int = 8, probe=None,
            max_grad_norm: float | None = None, optimizer=None, last=None,
            **engine_args) -> dict:
    """`probe(engine, inputs, target)`, when given, runs after the first step; what it returns
    comes back under "probe"; `last(engine)` after the last step, under "last". `max_grad_norm`: both sides clip by the global gradient norm
    (the reference with torch.nn.utils.clip_grad_norm_); the norms come back too.
    `optimizer`: a factory for both sides (default AdamW). `engine_args`: more keywords of
    parallelize (e.g. chunked_loss=False)."""
    import torch.distributed as dist

    import autopar

    model, inputs, target, loss_fn = build(name, batch)
    reference = copy.deepcopy(model)
    opt = optimizer or functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, optimizer=opt, plan=plan,
                                 max_grad_norm=max_grad_norm, **engine_args)
    ref_opt = opt(reference.parameters())
    loss_errors, measured, predicted, norms = [], {}, {}, []
    for step in range(steps):
        engine.comm_log.clear()
        loss = engine.train_step(inputs, target)
        if step == 0:
            measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
            predicted = engine.predicted_comm(batch)
            probed = probe(engine, inputs, target) if probe is not None else None
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(*inputs), target)
        ref_loss.backward()
        if max_grad_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
            norms.append((engine.last_grad_norm, float(ref_norm)))
        ref_opt.step()
        loss_errors.append(abs(loss - ref_loss.item()) / abs(ref_loss.item()))
    full = engine.full_state_dict()
    ref_state = reference.state_dict()
    floats = [k for k in ref_state if ref_state[k].dtype.is_floating_point]
    # Tensors whose exact value stays 0 (a key bias: softmax ignores it, so its true gradient
    # is 0) hold only rounding noise; relative error means nothing there, absolute does.
    noise = [k for k in floats if ref_state[k].norm() < 1e-6]
    weight_errors = {k: relative(full[k], ref_state[k]) for k in floats if k not in noise}
    noise_error = max([float((full[k] - ref_state[k]).abs().max()) for k in noise] or [0.0])
    held = engine.parameter_bytes()
    return {"loss": max(loss_errors), "weights": max(weight_errors.values()),
            "noise_abs": noise_error,
            "keys_equal": list(full) == list(ref_state), "measured": measured,
            "predicted": predicted, "held": held,
            "replicated": engine.replicated_parameters(), "probe": probed, "norms": norms,
            "last": last(engine) if last is not None else None}


def assert_equal(results: list[dict]) -> None:
    """Every rank of a `compare` run equals the single-device run: loss and final weights
    within 1e-5 relative, no Adam noise amplified, the same state_dict keys, and the bytes
    of every collective per (op, axis) as the plan predicted."""
    for r in results:
        assert r["loss"] <= 1e-5, r["loss"]
        assert r["weights"] <= 1e-5, r["weights"]
        assert r["noise_abs"] <= 1e-8, r["noise_abs"]
        assert r["keys_equal"]
        assert r["measured"] == r["predicted"]


def stepped_once(name: str, plan, batch: int = 8, compile: bool = False):
    """The engine of model `name` under `plan` over this rank's world (compiled if
    `compile`), after one SGD step (lr 1e-3) on a batch of `batch`: (engine, model, inputs,
    target)."""
    import torch.distributed as dist

    import autopar

    model, inputs, target, loss_fn = build(name, batch)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), plan=plan,
                                 compile=compile)
    engine.train_step(inputs, target)
    return engine, model, inputs, target


def counting_writes(written: dict, in_place_apart: bool = True):
    """A dispatch mode that adds to `written[op name]` the elements each op but a view
    writes; `in_place_apart`: an in-place op (`div_`) counted apart from its out-of-place
    form (`div`), else together under the plain name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not func.is_view:
                kind = func.overloadpacket.__name__
                kind = kind if in_place_apart else kind.rstrip("_")
                written[kind] = written.get(kind, 0) + out.numel()
            return out

    return Writes()
