"""DeepSeek-V3 (the zoo's `deepseek-v3`: MLA attention and its MoE) as the planner sees it.

Its attention is priced by its real projections (low-rank queries and keys/values, decoupled
rotary heads), and on 2048 H100 the search splits its experts over an ep axis, as every
published run of it does (64-way in its report, arXiv 2412.19437 §3.2).
"""

import functools

from autopar.models import workload
from autopar.search.planner import prepare, search
from autopar.world import World

SEQ = 4096
H, HEADS, EXPERTS, FFN, DENSE_FFN, VOCAB = 7168, 128, 256, 2048, 18432, 129280
Q_RANK, KV_RANK, NOPE, ROPE, V = 1536, 512, 128, 64, 128
# MLA's projections, (K, N) each: x -> q latent -> heads' q (128 + 64 rotary); x -> kv latent
# plus one shared rotary key; kv latent -> heads' k (128) and v (128); heads' v -> out
MLA_GEMMS = [(H, Q_RANK), (Q_RANK, HEADS * (NOPE + ROPE)), (H, KV_RANK + ROPE),
             (KV_RANK, HEADS * (NOPE + V)), (HEADS * V, H)]
MLA_PARAMS = sum(k * n for k, n in MLA_GEMMS) + Q_RANK + KV_RANK  # + the two latent norms


@functools.cache
def _chain():
    w = workload("deepseek-v3", batch=1, seq=SEQ)
    return prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                   tp_sizes=(1, 2, 4, 8), layers=w.layer_counts)


def test_mla_is_priced_by_its_real_projections():
    chain = _chain()
    blocks = [lt for lt in chain.layers() if lt.attention]
    assert len(blocks) == 61
    for block in (blocks[0], blocks[3]):  # a dense block and an MoE block
        assert [(g.k, g.n) for g in block.gemms[:5]] == MLA_GEMMS
        for g in block.gemms[:5]:  # forward: 2 x tokens x K x N
            assert g.flops(1) == 2 * SEQ * g.k * g.n
        (attn,) = block.attention
        # scores over q.k heads of 128 + 64, the weighted sum over values of 128
        assert attn.flops(1) == 2 * SEQ * SEQ * HEADS * (NOPE + ROPE + V)
    # the whole model by hand: 3 dense blocks and 58 MoE blocks (router, 256 routed experts,
    # one shared expert behind its [H, 1] gate), untied embeddings and the final norm
    swiglu = 3 * H
    dense = MLA_PARAMS + 2 * H + swiglu * DENSE_FFN
    moe = MLA_PARAMS + 2 * H + H * EXPERTS + EXPERTS * swiglu * FFN + swiglu * FFN + H
    assert chain.params == 3 * dense + 58 * moe + 2 * VOCAB * H + H


def test_deepseek_v3_on_2048_h100_splits_its_experts():
    chain = _chain()
    res = search(chain, World(2048, device="h100-80gb"), global_batch=2048)
    assert res.best.ep > 1 and res.best.fits
    assert res.best.memory_per_device <= 80 * 2 ** 30
    assert res.best.ep_comm_s > 0  # its all-to-alls are priced
