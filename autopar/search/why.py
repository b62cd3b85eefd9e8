"""Why a candidate lost, why nothing fits, and what the runtime cannot execute: the search's
sentences."""

from __future__ import annotations

import math

from autopar.cost.hardware import GiB
from autopar.cost.step import USABLE_MEMORY, host_capacity
from autopar.errors import PlanError
from autopar.modes import (
    CP,
    DP,
    PP,
    TP,
    TP_1D,
    Capabilities,
)
from autopar.plans.capabilities import lacking
from autopar.search.space import divisors


def lost(cand, winner, capacity: float, host: float) -> str:
    """Why `cand` is not the plan: short of device or host memory, or slower and by what."""
    if not cand.fits and cand.host_per_device > host:
        return (f"host memory short by {(cand.host_per_device - host) / GiB:.1f}"
                f" GiB per device ({cand.host_per_device / GiB:.1f} GiB offloaded, "
                f"{host / GiB:.1f} GiB of host memory per device)")
    if not cand.fits:
        over = cand.memory_per_device - capacity
        return (f"out of memory by {over / GiB:.1f} GiB per device "
                f"({cand.memory_per_device / GiB:.1f} GiB needed, "
                f"{capacity / GiB:.1f} GiB usable)")
    if winner is None:
        return "fits"
    pct = 100 * (cand.step_time / winner.step_time - 1)
    why = []
    if cand.bubble_s > winner.bubble_s * 1.2 + 1e-9:
        why.append(f"pipeline bubble {cand.bubble_s:.3f} s")
    if cand.comm_s - cand.ep_comm_s > (winner.comm_s - winner.ep_comm_s) * 1.2 + 1e-9:
        why.append(f"tensor/sequence comm {cand.comm_s - cand.ep_comm_s:.3f} s")
    if cand.ep_comm_s > winner.ep_comm_s * 1.2 + 1e-9:
        why.append(f"expert all-to-all {cand.ep_comm_s:.3f} s")
    if cand.dp_comm_s > winner.dp_comm_s * 1.2 + 1e-9:
        why.append(f"data-parallel sync {cand.dp_comm_s:.3f} s")
    if cand.compute_s > winner.compute_s * 1.05:
        why.append(f"compute {cand.compute_s:.3f} s")
    return f"{pct:.1f}% slower" + (f" ({', '.join(why)})" if why else "")


def no_mesh(c, chain, world: int, n_blocks: int) -> str:
    """Why no mesh of `world` devices meets the constraints `c`."""
    fixed = {k: v for k, v in vars(c).items() if k in (TP, PP, DP, CP) and v is not None}
    blocks = n_blocks or 1
    tiles = world % math.prod(fixed.values()) == 0
    if tiles and fixed.get(PP, 1) > blocks:
        return (f"pp {fixed[PP]} needs at least {fixed[PP]} blocks to put one on each "
                f"stage, but the model has {blocks}; use pp "
                f"{max(d for d in divisors(world) if d <= blocks)} or less.")
    if tiles and fixed.get(CP, 1) > 1:
        seq = chain.tokens_per_sample
        return (f"cp {fixed[CP]} splits the sequence over {fixed[CP]} ranks, but this "
                f"model has " + (f"a sequence of {seq} tokens, which it does not divide"
                                 if any(lt.attention for lt in chain.types) else
                                 "no attention to split") + "; choose another cp size.")
    if fixed:
        prod = math.prod(fixed.values())
        near = divisors(world)
        return (f"the fixed sizes {fixed} (product {prod}) cannot tile a world of {world} "
                f"devices; each size must divide {world} and their product must too "
                f"(divisors: {', '.join(map(str, near[:12]))}"
                f"{', ...' if len(near) > 12 else ''}).")
    return f"no way to split this model over {world} devices."


def too_many_devices(space, meshes, world: int, global_batch: int) -> str | None:
    """When `world` exceeds what the model can use at this batch, the sentence that says so.

    An upper bound, so that it never refuses a world a plan could use: for each dp dividing
    the batch and the world (each replica then has b = batch / dp samples), pp at most the blocks (one per
    stage), cp the largest size the sequence splits over, and tp the largest divisor of the
    world with a tensor mode that splits a micro-batch of b (1D where the layers split;
    2D/2.5D/3D grids also cut the micro-batch)."""
    blocks = max(1, space.n_blocks)
    cp_max = max(m[CP] for m in meshes)
    refused = space.refused_tensor_sizes_1d()
    sizes = divisors(world)

    def tp_max(b: int) -> int:
        return max(t for t in sizes if any(
            (mode.name == TP_1D and t not in refused) or
            (mode.name != TP_1D and b % mode.batch_split == 0) for mode in space.tp_modes(t)))

    best = max(((dp, tp_max(global_batch // dp))
                for dp in divisors(math.gcd(global_batch, world))),
               key=lambda pair: pair[0] * pair[1])
    most = best[0] * blocks * cp_max * best[1]
    if world <= most:
        return None
    return (f"a world of {world} devices is more than this model can use at a global batch "
            f"of {global_batch}: at most {most} (dp {best[0]} x pp {blocks}, one block per "
            f"stage, x cp {cp_max} x tp {best[1]}, the largest sizes its batch, sequence and "
            f"layers split over); use {most} devices or fewer, or a larger global batch.")


def no_leaf(space, meshes, global_batch: int) -> str:
    """Why no micro-batch and schedule of any mesh left meets the constraints."""
    gb, c = global_batch, space.c
    dps = sorted({m[DP] for m in meshes})
    split = [m for m in meshes if gb % m[DP] == 0]
    refused_1d = space.refused_tensor_sizes_1d()
    refused = {m[TP]: refused_1d[m[TP]] for m in split if m[TP] in refused_1d}
    if split and all(m[TP] in refused and all(mode.name == TP_1D for mode in
                                                space.tp_modes(m[TP])) for m in split):
        tp = split[0][TP]
        other = sorted({m[DP] for m in meshes} - {m[DP] for m in split})
        return (f"tensor size {tp} cannot split this model: {refused[tp]}" +
                (f"; or give a global batch that is a multiple of {other[0]} (data "
                 "parallelism)." if other else "."))
    m_fixed = c.microbatches
    if split and m_fixed is not None and all((gb // m[DP]) % m_fixed for m in split):
        m = split[0]
        per = gb // m[DP]
        return (f"microbatches {m_fixed} does not divide the {per} sample(s) per "
                f"data-parallel replica (global batch {gb} over dp {m[DP]}); use a number "
                f"of micro-batches that divides {per}, or a global batch that is a multiple "
                f"of {m_fixed * m[DP]}.")
    if split and all(m[PP] > 1 for m in split):
        m = min(split, key=lambda m: m[PP])
        per_replica = gb // m[DP]
        return (f"every mesh left has a pipeline, and none gets as many micro-batches as "
                f"stages: with pp {m[PP]} and dp {m[DP]} each replica has "
                f"{per_replica} sample(s) for {m[PP]} stages; use a global batch of at "
                f"least {m[PP] * m[DP]}, or fewer stages (pp).")
    if split:
        tp = split[0][TP]
        return (f"no micro-batch size fits the constraints: the global batch {gb} over dp "
                f"{split[0][DP]} gives {gb // split[0][DP]} sample(s) per replica; "
                "relax microbatches or the tensor mode (2D/2.5D/3D split the micro-batch "
                "too)" + (f", as 1d cannot split tensor size {tp} ({refused[tp]})"
                          if tp in refused else "") + ".")
    return (f"the global batch {gb} does not split over any data-parallel size this world "
            f"allows ({', '.join(map(str, dps[:10]))}); use a batch that is a multiple of "
            f"{dps[0]}" + (f" or fix dp to a divisor of {gb}" if len(dps) > 1 else "") + ".")


def not_executable(caps: Capabilities) -> list[str]:
    """What a runtime of these capabilities cannot execute yet, in the capability table's
    words (autopar.plans.capabilities, which Plan.unsupported says too)."""
    return [f"{words}: the runtime cannot execute it yet" for _, words in lacking(caps)]


def nothing_fits(result, world) -> str:
    """Why the search found no plan that fits, and how many devices would do."""
    if not result.alternatives:
        return f"no plan exists for this model on {world.devices} devices."
    closest, _ = min(result.alternatives, key=lambda a: a[0].memory_per_device)
    need = closest.memory_per_device
    cap = world.profile.memory_bytes * USABLE_MEMORY
    if need <= cap:  # fits the device, not the host its offloaded state goes to
        host = host_capacity(world.profile, world.per_node, world.devices)
        return (f"no plan fits in memory on {world.devices} x {world.device}: the closest, "
                f"{closest.describe()}, offloads {closest.host_per_device / 2 ** 30:.1f} GiB "
                f"per device to the host, which has {host / 2 ** 30:.1f} GiB per device (the "
                "profile's host_memory_bytes per node over its devices); use more devices "
                "(`autopar explain --min-devices` finds the fewest) or a profile with more host "
                "memory.")
    return (f"no plan fits in memory on {world.devices} x {world.device}: the closest, "
            f"{closest.describe()}, needs {need / 2 ** 30:.1f} GiB per device of "
            f"{cap / 2 ** 30:.1f} GiB usable; about "
            f"{_round_up(world.devices * (need / cap), world.per_node)} devices would be "
            "needed (a world of that size; `autopar explain --min-devices` finds the fewest).")


def _round_up(x: float, k: int) -> int:
    n = int(-(-x // 1))
    return -(-n // k) * k


def check_ep(c, space, executable, meshes) -> None:
    """One sentence for a fixed ep no mesh can take."""
    ep, counts = c.ep, space.expert_counts()
    if not counts:
        raise PlanError(f"ep={ep} splits experts, but the model has no mixture-of-experts "
                        "layer; drop ep.")
    if any(n % ep for n in counts):
        raise PlanError(f"{min(counts)} experts do not split over ep={ep} ranks; choose an "
                        "expert-parallel size that divides the number of experts.")
    if executable is not None and not executable.expert_with_cp and \
            not any(space.ep_sizes(m) for m in meshes):
        raise PlanError(f"ep={ep}: the runtime runs an expert axis inside the data-parallel "
                        "ranks alone (no cp axis beside it), and no mesh of this world with "
                        f"these constraints has dp divisible by {ep}; fix dp to a multiple "
                        f"of {ep} and cp to 1.")
    if not any(space.ep_sizes(m) for m in meshes):
        raise PlanError(f"ep={ep} must divide the data-parallel ranks dp x cp, and no mesh "
                        "of this world with these constraints has dp x cp divisible by "
                        f"{ep}; fix dp (or cp) to a multiple of {ep}.")
