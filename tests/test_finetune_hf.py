"""Fine-tuning a pretrained transformers model (gloo, world 2): a LlamaForCausalLM written by
`save_pretrained` is started from a meta-built copy with `weights=DIR` under tp 2, ZeRO-3
and pp 2; three AdamW steps equal `from_pretrained` trained on one device; `engine.export`
loads back with `AutoModelForCausalLM.from_pretrained` to the engine's weights exactly.
Weights that do not fit the model are refused in one sentence before any training."""

import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture

transformers = pytest.importorskip("transformers")

pool2 = dist_pool_fixture(2)

PLANS = {"tensor": {"tensor": {"size": 2, "mode": "1d"}},
         "zero3": {"data": 2, "zero": {"stage": 3}},
         "pipeline": {"pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 4}}}


def _config(tie: bool = True):
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=tie)


def _loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pretrained") / "llama"
    transformers.LlamaForCausalLM(_config()).save_pretrained(path)
    return str(path)


def _finetune(pretrained: str, plan: dict, out: str, steps: int = 3) -> dict:
    import torch.distributed as dist

    import autopar

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(pretrained))
    reference = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(model, 2, example_inputs=(x[:2],), loss_fn=_loss,
                                 optimizer=opt, plan=plan, weights=pretrained)
    ref_opt = opt(reference.parameters())
    losses = []
    for _ in range(steps):
        loss = engine.train_step(x, y)
        ref_opt.zero_grad()
        ref_loss = _loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / ref_loss.item())
    engine.export(out)
    full = engine.full_state_dict()
    dist.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    ref_state = reference.state_dict()
    return {"loss": max(losses),
            "keys": sorted(loaded) == sorted(full) == sorted(ref_state),
            "exported": [k for k in full if not torch.equal(loaded[k], full[k])],
            "trained": max(float((full[k] - ref_state[k]).norm() /
                                 ref_state[k].norm().clamp_min(1e-12)) for k in ref_state)}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_finetune_from_save_pretrained_and_export(pool2, pretrained, tmp_path, plan):
    for r in pool2.run(_finetune, pretrained, PLANS[plan], str(tmp_path / "export")):
        assert r["loss"] < 1e-5, r["loss"]
        assert r["keys"] and r["exported"] == []
        assert r["trained"] < 1e-5, r["trained"]


def test_weights_that_do_not_fit_are_refused_before_training(pretrained, tmp_path):
    import autopar
    from autopar.errors import WeightsError

    x = torch.zeros(2, 8, dtype=torch.long)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())
    state = transformers.AutoModelForCausalLM.from_pretrained(pretrained).state_dict()
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(WeightsError, match=r"missing model\.norm\.weight") as e:
        autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_loss, weights=missing)
    assert str(e.value).count(". ") == 0  # one sentence
    wrong = dict(state, **{"model.norm.weight": torch.ones(16)})
    with pytest.raises(WeightsError, match=r"model\.norm\.weight has shape \(16,\)"):
        autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_loss, weights=wrong)
