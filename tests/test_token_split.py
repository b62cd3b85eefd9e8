"""Context parallelism's token splits beyond [batch, tokens, ...] activations, on one process.

- A mask the graph builds from positions alone is recognised as causal (`autopar.graph.masks`)
  and only then: a mask read from an input, or a banded one, is not.
- A split on the tokens survives flattening [B, S, ...] into [B*S, ...] as a batch-major
  split (`groups` = -run; `Layout`), and the way back; the run-time gather and slice of such
  a split agree with the layout.
- The cp plan of transformers' GPT-2 runs its attention on the sequence kernels, takes the
  loss on each rank's tokens, and its rewritten graph no longer builds the mask.
"""

import sys

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from autopar.graph.masks import is_causal_mask
from autopar.graph.trace import BATCH, trace
from autopar.kernels.collectives import _deinterleave, _interleave
from autopar.passes.tensor_parallel import apply_solution
from autopar.sharding.axes import TensorMesh
from autopar.sharding.layout import Layout, Shard, block_count
from autopar.sharding.rules.views import reshape_shard
from autopar.sharding.solve import solve

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from equivalence import build  # noqa: E402

aten = torch.ops.aten


class _Attend(nn.Module):
    """One attention whose mask comes from `make_mask(x, pad)`."""

    def __init__(self, make_mask):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.make_mask = make_mask

    def forward(self, x, pad):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(x, pad))


def _mask_of(make_mask) -> bool:
    x, pad = torch.randn(2, 8, 16), torch.ones(2, 8, dtype=torch.bool)
    traced = trace(_Attend(make_mask), (x, pad), train=False)
    sdpa = next(n for n in traced.graph.nodes
                if n.target is aten.scaled_dot_product_attention.default)
    mask = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs["attn_mask"]
    return is_causal_mask(mask)


def _positions(x):
    s = x.shape[1]
    i = torch.arange(s, device=x.device)
    return i[:, None], i[None, :]


@pytest.mark.parametrize("make_mask,causal", [
    (lambda x, pad: (lambda r, c: c <= r)(*_positions(x)), True),
    (lambda x, pad: torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1), True),
    (lambda x, pad: ((lambda r, c: (c <= r) & (c > r - 3))(*_positions(x))), False),
    (lambda x, pad: ((lambda r, c: c <= r)(*_positions(x)))[None, None] & pad[:, None, None, :],
     False),
    (lambda x, pad: torch.zeros(x.shape[1], x.shape[1]), False),
])
def test_causal_masks_are_recognised(make_mask, causal):
    """Boolean and additive lower triangles count; a band, a padding mask read from an
    input (its values could be anything) and an all-visible mask do not."""
    assert _mask_of(make_mask) is causal


def test_flattening_a_token_split_keeps_it():
    s = 32
    shard = Shard(1, "cp")
    flat, _ = reshape_shard((BATCH, s, 256), (s * BATCH, 256), shard, 4)
    assert flat == Shard(0, "cp", -s)
    assert repr(Layout(2, (flat,))) == "S(cp)/32 R"
    back, _ = reshape_shard((s * BATCH, 96), (BATCH, s, 96), flat, 4)
    assert back == Shard(1, "cp", 1)
    # [B, S, H, D] -> [B*S*H*D]: runs of S*H*D per sample
    assert reshape_shard((BATCH, s, 2, 8), (s * 16 * BATCH,), shard, 4)[0] == Shard(0, "cp", -512)
    # a split that is not the dim right after the batch, or that does not divide: no layout
    assert reshape_shard((BATCH, 4, s), (4 * s * BATCH,), Shard(2, "cp"), 4)[0] is None
    assert reshape_shard((BATCH, 6, 8), (6 * BATCH, 8), shard, 4)[0] is None


def test_batch_major_gather_and_slice_match_the_layout():
    """[B*S] split S(cp)/S over 4 ranks: rank r holds tokens r*S/4..(r+1)*S/4 of every
    sample, flattened; gathering puts them back in order, slicing takes them again."""
    b, s, parts = 3, 8, 4
    whole = torch.arange(b * s * 2, dtype=torch.float32).view(b * s, 2)
    blocks = [whole.view(b, s, 2)[:, r * s // parts:(r + 1) * s // parts].reshape(-1, 2)
              for r in range(parts)]
    assert block_count(-s, b * s, parts, whole=True) == b
    assert block_count(-s, b * s // parts, parts, whole=False) == b
    assert torch.equal(_interleave(torch.stack(blocks), 0, -s), whole)
    sliced = _deinterleave(whole, 0, -s, parts)
    for r in range(parts):
        assert torch.equal(sliced[r], blocks[r])
    with pytest.raises(ValueError, match="per-sample runs"):
        block_count(-s, 10, parts, whole=True)


def test_gpt2_cp_plan_uses_the_kernels_and_drops_the_mask():
    model, inputs, target, loss_fn = build("hf-gpt2", 4)
    traced = trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True)
    mesh = TensorMesh("1d", (("cp", 2), ("tp", 1)))
    solution = solve(traced, axis="tp", size=1, mesh=mesh, sequence_mode="ring")
    by_name = {n.name: s for n, s in solution.strategies.items()}
    sdpa = [n for n in traced.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert sdpa and all(by_name[n.name].args["sequence"]["is_causal"] for n in sdpa)
    loss = next(n for n in traced.graph.nodes if n.target is aten.cross_entropy_loss.default)
    assert by_name[loss.name].name == "token_parallel"
    logits = solution.layouts[loss.args[0]]
    assert logits.shard_on("cp") == Shard(0, "cp", -8)
    assert not [t for t in solution.transitions
                if any(c.op == "all_gather" and c.phase == "forward" for c in t.comm)]
    local = apply_solution(traced.gm, solution)
    targets = {n.target for n in local.graph.nodes if n.op == "call_function"}
    assert not targets & {aten.scaled_dot_product_attention.default, aten.eq.Tensor,
                          aten.__and__.Tensor, aten.cumsum.default}
    square = [n for n in local.graph.nodes if n.op == "call_function" and
              getattr(n.meta.get("autopar"), "shape", None) and
              tuple(n.meta["autopar"].shape[-2:]) == (sympy.Integer(8), sympy.Integer(8))
              and len(n.meta["autopar"].shape) == 4 and n.meta["autopar"].shape[1] == 1]
    assert not square, [n.name for n in square]


def test_a_mask_too_large_to_check_gathers_the_sequence_and_says_so(monkeypatch):
    """Masks are evaluated up to `MAX_ELEMENTS` (16384^2 at batch 1); past it GPT-2's
    attention runs with the sequence gathered and the plan's note says why."""
    import autopar.graph.masks as masks

    monkeypatch.setattr(masks, "MAX_ELEMENTS", 8 * 8 - 1)  # GPT-2's test mask is 8 x 8
    model, inputs, target, loss_fn = build("hf-gpt2", 4)
    traced = trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True)
    mesh = TensorMesh("1d", (("cp", 2), ("tp", 1)))
    solution = solve(traced, axis="tp", size=1, mesh=mesh, sequence_mode="ring")
    sdpa = [s for n, s in solution.strategies.items()
            if n.target is aten.scaled_dot_product_attention.default]
    assert sdpa and all(s.name == "replicate" and "too large to check" in s.note for s in sdpa)
