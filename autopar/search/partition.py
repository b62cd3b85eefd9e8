"""Pipeline stages balanced by cost (`balance`, `balance_within`: a bisection on the
slowest stage) and the per-layer state along the chain (`choose_states`: a Viterbi pass
trading time for activation bytes by a Lagrange multiplier)."""

from __future__ import annotations

import bisect

import numpy as np


def balance(costs, k: int) -> list[int]:
    """Stage index of each layer: ``k`` contiguous stages (each of one layer at least), the
    slowest as fast as possible. Exact (``balance_dp``'s bottleneck): a bisection on it,
    each probe cutting greedily in O(k log n)."""
    costs = [float(c) for c in costs]
    n = len(costs)
    if k <= 1:
        return [0] * n
    if k > n:
        raise ValueError(f"cannot split {n} layers into {k} stages.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    total = prefix[-1]

    right = bisect.bisect_right

    def cuts(limit: float, ends: list | None = None) -> bool:
        """Whether greedy stages within ``limit`` number k or fewer (their ends into `ends`)."""
        reach, start, used = limit * (1 + 1e-12), 0, 0
        while start < n:  # (prefix[:start + 1] <= prefix[start] + reach: costs >= 0)
            end = right(prefix, prefix[start] + reach, start + 1) - 1
            if end <= start:
                end = start + 1
            used += 1
            if used > k:
                return False
            if ends is not None:
                ends.append(end)
            start = end
        return True

    lo = max(max(costs), total / k)
    hi = lo + max(costs)
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if cuts(mid):
            hi = mid
        else:
            lo = mid
    ends: list = []
    cuts(hi, ends)
    # give every stage at least one layer: split the last stages' tails if greedy used fewer
    while len(ends) < k:
        widths = [b - a for a, b in zip([0] + ends, ends)]
        widest = widths.index(max(widths))  # (the first of the widest)
        start = ends[widest - 1] if widest else 0
        if ends[widest] - start < 2:
            break
        ends.insert(widest, ends[widest] - 1)
    stages, s = [0] * n, 0
    for layer in range(n):
        while layer >= ends[s]:
            s += 1
        stages[layer] = s
    return stages


def balance_within(costs, weights, capacity, k: int) -> list[int] | None:
    """``balance`` with stage s holding at most ``capacity[s]`` of ``weights[s]`` (per layer,
    its bytes on stage s); None when no split fits. Each probe cuts greedily from the last
    stage, which is exact when later stages hold no more per layer (1F1B's in-flight
    micro-batches fall along the pipeline) and capacities are equal."""
    costs = np.asarray(costs, dtype=float)
    weights = np.asarray(weights, dtype=float)  # [k, n]
    n = len(costs)
    if k <= 1 or k > n:
        return [0] * n if k <= 1 and weights[0].sum() <= capacity[0] else None
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def starts_within(limit: float):
        """Where each stage starts (stage 0 at 0), or None when no split fits B=limit."""
        out, end = [], n
        for s in range(k - 1, -1, -1):
            start, w = end, 0.0
            while start > s and prefix[end] - prefix[start - 1] <= limit * (1 + 1e-12) and \
                    w + weights[s, start - 1] <= capacity[s] * (1 + 1e-12):
                w += weights[s, start - 1]
                start -= 1
            if start == end or (s == 0 and start != 0):
                return None
            out.append(start)
            end = start
        return out[::-1]

    # every bottleneck is some run's time; a one-layer run read off the prefix sums can
    # round a hair below that layer's own cost, so the floor keeps a relative slack (the
    # greedy check allows the same slack above the limit)
    candidates = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(n + 1, 1)])
    candidates = candidates[candidates >= costs.max() * (1 - 1e-12)]
    lo, hi = 0, len(candidates) - 1
    if starts_within(candidates[hi]) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if starts_within(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    starts = starts_within(candidates[hi])
    stages, s = [0] * n, 0
    for layer in range(n):
        while s + 1 < k and layer >= starts[s + 1]:
            s += 1
        stages[layer] = s
    return stages


def balance_dp(costs, k: int) -> list[int]:
    """The same partition by dynamic programming over the chain (the reference ``balance``
    is checked against): dp[s][j] = min_i max(dp[s-1][i], cost(i..j)). Exact, O(k n^2)."""
    costs = np.asarray(costs, dtype=float)
    n = len(costs)
    if k <= 1:
        return [0] * n
    if k > n:
        raise ValueError(f"cannot split {n} layers into {k} stages.")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    # best[s][j]: slowest stage of the best split of layers [0, j) into s+1 stages
    best = np.full((k, n + 1), inf)
    cut = np.zeros((k, n + 1), dtype=int)
    best[0, 1:] = prefix[1:]
    seg = prefix[None, :] - prefix[:, None]  # seg[i, j] = cost of layers [i, j)
    idx = np.arange(n + 1)
    for s in range(1, k):
        # candidate i (last cut) must leave >= 1 layer per earlier stage and this stage
        cand = np.maximum(best[s - 1][:, None], seg)
        cand[idx[:, None] >= idx[None, :]] = inf
        cand[: s, :] = inf
        cut[s] = np.argmin(cand, axis=0)
        best[s] = cand[cut[s], idx]
    stages = [0] * n
    j = n
    for s in range(k - 1, -1, -1):
        i = cut[s][j] if s > 0 else 0
        for layer in range(i, j):
            stages[layer] = s
        j = i
    return stages


def choose_states(layer_states, time, memory, convert, price: float) -> tuple[list[int], float]:
    """Viterbi over the chain. ``layer_states[l]``: how many states layer l has;
    ``time[l][a]``, ``memory[l][a]``: arrays per state; ``convert[l][a, b]``: seconds to
    go from state a of layer l-1 to state b of layer l. Returns (state per layer, cost).
    In plain floats (a layer has a few states): each sum as an array would add it, each
    state's best predecessor the first of the least."""
    n = len(layer_states)
    cost = [t + price * m for t, m in zip(np.asarray(time[0]).tolist(),
                                          np.asarray(memory[0]).tolist())]
    back = []
    rows: dict = {}  # each conversion matrix's rows as lists, once per call
    for layer in range(1, n):
        matrix = convert[layer]
        conv = rows.get(id(matrix))
        if conv is None:
            conv = rows[id(matrix)] = (matrix, np.asarray(matrix).T.tolist())
        conv = conv[1]  # [state b][state a before it]
        arg, nxt = [], []
        for into, t, m in zip(conv, np.asarray(time[layer]).tolist(),
                              np.asarray(memory[layer]).tolist()):
            best, at = cost[0] + into[0], 0
            for a in range(1, len(cost)):
                v = cost[a] + into[a]
                if v < best:
                    best, at = v, a
            arg.append(at)
            nxt.append(best + t + price * m)
        back.append(arg)
        cost = nxt
    last = min(range(len(cost)), key=cost.__getitem__)
    total = float(cost[last])
    path = [last]
    for arg in reversed(back):
        path.append(arg[path[-1]])
    path.reverse()
    return path, total
