# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The balanced owner rule's refinement: a deterministic local search.

:func:`refine` lowers the score of the most loaded rank by moving one of its
matrices or swapping one with a matrix elsewhere, until no move or swap
helps (the rule in :mod:`.muon_sharding_partition`'s docstring, step 4).
Two exact searches give the same choice: over pairs of matrix kinds when
kinds are few, rank by rank otherwise. Works on the rule's own loads
(``_Loads``: ``b``, ``c``, ``tb``, ``tc``, ``pref``, ``by_score``, ``add``),
name -> owner map and sizes; imports nothing of the rule.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import Dict, List, Tuple

__all__ = ["refine"]

# The kind-pair search keeps, per kind, the list of smaller kinds: at most
# this many kinds keeps those lists small (~16 MB at worst).
_MAX_PAIRED_KINDS = 512


def refine(owner, loads, bts, nss, classes, allowed_of, order, max_iters=10000):
    """Deterministic local search: lower the score of the most loaded rank by
    moving one of its matrices, or swapping one with a matrix elsewhere.

    Each round takes the best improving move/swap: lowest new pair score,
    then moves before swaps, matrix name, ``rank_order``, partner name.
    Matrices of equal (bytes, NS cost, dtype) -- a *kind* -- are
    interchangeable. Two exact searches give that same choice: over pairs of
    kinds when kinds are few (real models: repeated layers and experts), and
    rank by rank otherwise (with nearly every matrix a kind of its own, a
    kind window holds thousands of kinds, a rank's window only a few). On
    synthetic models the first is ~4x faster with 96 kinds over 1,024 ranks
    (200,000 matrices), the second ~2x faster with 491 kinds over 512 ranks.
    """
    n = loads.n
    if n == 1:
        return
    dtype_of = {k: d for d, names in classes.items() for k in names}
    # every matrix's kind (scaled bytes, scaled NS cost, dtype); each rank
    # keeps its kinds -> names (sorted), the smallest name being the one the
    # name tie-break picks among interchangeable matrices
    gkey = {k: (bts[k] * loads.tc, nss[k] * loads.tb, dtype_of[k]) for k in bts}
    groups: List[Dict[tuple, List[str]]] = [{} for _ in range(n)]
    for k in sorted(owner):
        groups[owner[k]].setdefault(gkey[k], []).append(k)
    kinds = len(set(gkey.values()))
    few = 2 * kinds <= n and kinds <= _MAX_PAIRED_KINDS
    search = _refine_by_kind if few else _refine_by_rank
    search(owner, loads, bts, nss, dtype_of, gkey, groups, allowed_of, order, max_iters)


def _refine_by_kind(owner, loads, bts, nss, dtype_of, gkey, groups, allowed_of, order,
                    max_iters=10000):
    """:func:`_refine` for few kinds of matrices (at most one per two ranks,
    at most ``_MAX_PAIRED_KINDS``).

    Matrices of equal (bytes, NS cost, dtype) -- a *kind* -- are
    interchangeable and ranks sit on few distinct load points, so the search
    runs over pairs of kinds and over load points, not matrices and ranks:
    a kind ``k`` of the worst rank against a kind ``j`` held elsewhere (or
    nothing: a move). With ``(dx, dy)`` what the partner gains, the new pair
    score is ``max(A, x + dx, y + dy)``, ``A`` the worst rank's side. Over
    the lower-left staircase of the load points that has an exact lower bound
    per pair (one bisection), so pairs are resolved in (bound, name) order
    and only while they can still win. A point's ranks and a kind's holders
    are bitsets over ``rank_order`` positions: resolving a pair is a few
    bisections and bitwise ands (see ``resolve``), and the lowest set bit is
    the tie-break winner. Exact: the frozen rule's choice every round.
    """
    n = loads.n
    tb, tc = loads.tb, loads.tc
    pref = loads.pref

    # ranks as bits of their rank_order position: the lowest set bit of a
    # set of ranks is the one the tie-break prefers
    bit = [1 << p for p in pref]
    everyone = (1 << n) - 1
    allowed_bits = {d: everyone if a is None else sum(bit[r] for r in a)
                    for d, a in allowed_of.items()}
    holders: Dict[tuple, int] = {}  # kind -> ranks holding it
    for r in range(n):
        for g in groups[r]:
            holders[g] = holders.get(g, 0) | bit[r]
    # every kind (the set is fixed: matrices only change owner), by x
    kinds = sorted(holders)
    smaller: Dict[tuple, tuple] = {}

    def smaller_kinds(gk: tuple) -> tuple:
        """The kinds a matrix of kind gk may be swapped with (smaller sum),
        by x, as (kind, y, dx, dy) with (dx, dy) = gk - kind; and their x."""
        got = smaller.get(gk)
        if got is None:
            xk, yk = gk[0], gk[1]
            lst = [g for g in kinds if g[0] + g[1] < xk + yk]
            got = smaller[gk] = ([(g, g[1], xk - g[0], yk - g[1]) for g in lst],
                                 [g[0] for g in lst])
        return got

    # scaled loads per rank and the distinct load points (x, y) -> ranks,
    # sorted by x and by y with their coordinate and rank set alongside
    xl = [b * tc for b in loads.b]
    yl = [c * tb for c in loads.c]
    points: Dict[Tuple[int, int], int] = {}
    for r in range(n):
        p = (xl[r], yl[r])
        points[p] = points.get(p, 0) | bit[r]
    points_x = sorted(points)
    points_xv = [p[0] for p in points_x]
    points_xb = [points[p] for p in points_x]
    points_y = sorted((y, x) for x, y in points)
    points_yv = [q[0] for q in points_y]
    points_yb = [points[(x, y)] for y, x in points_y]

    def leave(r: int) -> None:
        x, y = xl[r], yl[r]
        left = points[(x, y)] ^ bit[r]
        i = bisect.bisect_left(points_x, (x, y))
        j = bisect.bisect_left(points_y, (y, x))
        if left:
            points[(x, y)] = points_xb[i] = points_yb[j] = left
        else:
            del points[(x, y)]
            del points_x[i], points_xv[i], points_xb[i]
            del points_y[j], points_yv[j], points_yb[j]

    def join(r: int) -> None:
        x, y = xl[r], yl[r]
        i = bisect.bisect_left(points_x, (x, y))
        j = bisect.bisect_left(points_y, (y, x))
        if (x, y) in points:
            points[(x, y)] = points_xb[i] = points_yb[j] = points[(x, y)] | bit[r]
        else:
            points[(x, y)] = bit[r]
            points_x.insert(i, (x, y))
            points_xv.insert(i, x)
            points_xb.insert(i, bit[r])
            points_y.insert(j, (y, x))
            points_yv.insert(j, y)
            points_yb.insert(j, bit[r])

    free = all(a is None for a in allowed_of.values())  # no capped class
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right

    def resolve(A, dx, dy, mask, low, bound):
        """Lowest (max(A, x + dx, y + dy), rank_order position) over the
        ranks in ``mask`` if at most ``bound``, else None; ``low`` <= it.

        The ranks scoring at most t are those whose load point is in the
        quadrant x <= t - dx, y <= t - dy: the ranks of the points up to
        t - dx in x AND of those up to t - dy in y (a rank has one point),
        i.e. two prefix unions. That set only grows with t, so the lowest t
        is found by bisection over the points' coordinates."""
        def reach(t):
            return (x_upto[bisect_right(points_xv, t - dx)]
                    & y_upto[bisect_right(points_yv, t - dy)] & mask)

        if not reach(bound):
            return None
        ranks = reach(low)
        if ranks:
            return low, (ranks & -ranks).bit_length() - 1
        # the score is some x + dx or y + dy in (low, bound]: the least
        # x + dx that reaches, then the least y + dy below it, by bisection
        # over the sorted coordinates
        t = bound
        for vals, d in ((points_xv, dx), (points_yv, dy)):
            lo = bisect_right(vals, low - d)
            hi = bisect_right(vals, t - d)
            while lo < hi:
                mid = (lo + hi) // 2
                if reach(vals[mid] + d):
                    hi = mid
                else:
                    lo = mid + 1
            if lo < len(vals) and vals[lo] + d <= t and reach(vals[lo] + d):
                t = vals[lo] + d
        ranks = reach(t)
        return t, (ranks & -ranks).bit_length() - 1

    def relocate(k: str, src: int, dst: int) -> None:
        # (src and dst have left their load points; they join them after)
        g = gkey[k]
        loads.add(src, -bts[k], -nss[k])
        loads.add(dst, bts[k], nss[k])
        xl[src] -= g[0]
        yl[src] -= g[1]
        xl[dst] += g[0]
        yl[dst] += g[1]
        owner[k] = dst
        names = groups[src][g]
        del names[bisect.bisect_left(names, k)]
        if not names:
            del groups[src][g]
            holders[g] ^= bit[src]
        if g in groups[dst]:
            bisect.insort(groups[dst][g], k)
        else:
            groups[dst][g] = [k]
            holders[g] |= bit[dst]

    for _ in range(max_iters):
        worst = loads.worst_rank()
        W = loads.score(worst)
        xw, yw = xl[worst], yl[worst]
        others = everyone ^ bit[worst]
        mine = [(names[0], g) for g, names in groups[worst].items()]

        # lower-left staircase of the other ranks' load points: x rising,
        # y falling, so s = x - y rising
        stair_x, stair_y, stair_s = [], [], []
        for (x, y), ranks in zip(points_x, points_xb):
            if (stair_y and y >= stair_y[-1]) or ranks == bit[worst]:
                continue
            stair_x.append(x)
            stair_y.append(y)
            stair_s.append(x - y)
        last = len(stair_s)
        # ranks of the points up to each index, by x and by y
        x_upto = list(itertools.accumulate(points_xb, operator.or_, initial=0))
        y_upto = list(itertools.accumulate(points_yb, operator.or_, initial=0))

        def lowest(dx, dy):
            # min over the points of max(x + dx, y + dy): points with
            # s >= dy - dx score x + dx, the others y + dy
            i = bisect.bisect_left(stair_s, dy - dx)
            if i == last:
                return stair_y[i - 1] + dy
            if i == 0:
                return stair_x[0] + dx
            return min(stair_x[i] + dx, stair_y[i - 1] + dy)

        # moves k -> r: A = the worst rank without k, (dx, dy) = k
        pairs = []
        for k, g in mine:
            xk, yk = g[0], g[1]
            A = max(xw - xk, yw - yk)
            low = max(A, lowest(xk, yk))
            if low < W:
                pairs.append((low, k, A, xk, yk, g[2]))
        pairs.sort(key=lambda q: (q[0], q[1]))
        best = None  # (new pair max, kind, k, rank pos, partner)
        bound = W - 1  # a candidate must lower the worst score
        for low, k, A, xk, yk, d in pairs:
            if low > bound or best is not None and (low, k) > (best[0], best[2]):
                break  # sorted: no later pair can win
            got = resolve(A, xk, yk, others & allowed_bits[d], low, bound)
            if got is not None:
                cand = (got[0], 0, k, got[1], "")
                if best is None or cand < best:
                    best, bound = cand, got[0]

        # swaps k <-> j, j smaller than k: (dx, dy) = k - j. A swap must beat
        # the best move outright (moves win ties)
        bound = W - 1 if best is None else best[0] - 1
        # dtypes the worst rank may take back (capped classes keep their owners)
        host_ok = None if free else {d for d, a in allowed_of.items()
                                     if a is None or worst in a}
        mx, my = stair_x[0], stair_y[-1]  # least loads of the other ranks
        # a swap keeps the pair's sum in each dimension, so the new pair score
        # is at least half of it: partners above 2 * bound - (the worst
        # rank's load) in either dimension are out of reach
        reachable = others & (
            x_upto[bisect.bisect_right(points_xv, 2 * bound - xw)]
            & y_upto[bisect.bisect_right(points_yv, 2 * bound - yw)])
        pairs = []
        for k, gk in mine:
            xk, yk = gk[0], gk[1]
            mask_k = reachable & allowed_bits[gk[2]]
            if not mask_k:
                continue
            cands, cands_x = smaller_kinds(gk)
            # x_j window: the worst rank's side xw - xk + xj <= bound, the
            # partner's mx + xk - xj <= bound; the same in y
            lo = bisect.bisect_left(cands_x, xk + mx - bound)
            hi = bisect.bisect_right(cands_x, bound - xw + xk, lo)
            y_lo, y_hi = yk + my - bound, bound - yw + yk
            for gj, yj, dx, dy in cands[lo:hi]:
                if yj < y_lo or yj > y_hi:
                    continue
                if host_ok is not None and gj[2] not in host_ok:
                    continue
                mask = holders[gj] & mask_k
                if not mask:
                    continue
                A = max(xw - dx, yw - dy)  # <= bound: the windows above
                # max(A, lowest(dx, dy)) inlined: this loop is the hot one
                i = bisect_left(stair_s, dy - dx)
                if i == last:
                    low = stair_y[i - 1] + dy
                elif i == 0:
                    low = stair_x[0] + dx
                else:
                    low = min(stair_x[i] + dx, stair_y[i - 1] + dy)
                if A > low:
                    low = A
                if low <= bound:
                    pairs.append((low, k, gj, A, dx, dy, mask))
        pairs.sort(key=lambda q: (q[0], q[1]))
        swap = None
        for low, k, gj, A, dx, dy, mask in pairs:
            if low > bound or swap is not None and (low, k) > (swap[0], swap[2]):
                break
            got = resolve(A, dx, dy, mask, low, bound)
            if got is not None:
                r = order[got[1]]
                cand = (got[0], 1, k, got[1], groups[r][gj][0])
                if swap is None or cand < swap:
                    swap, bound = cand, got[0]
        if swap is not None:
            best = swap  # strictly below any move
        if best is None:
            return
        _, kind, k, rpos, j = best
        r = order[rpos]
        leave(worst)
        leave(r)
        relocate(k, worst, r)
        if kind == 1:
            relocate(j, r, worst)
        join(worst)
        join(r)


# Ranks (least loaded first) the refinement's probe pass tries per matrix.
_PROBE_RANKS = 16


def _refine_by_rank(owner, loads, bts, nss, dtype_of, gkey, groups, allowed_of, order,
                    max_iters=10000):
    """:func:`_refine` for many kinds of matrices: rank-major.

    Each round takes the best improving move/swap (lowest new pair score ``B``,
    then moves before swaps, matrix name, ``rank_order``, partner name). Only
    candidates that can reach the best ``B`` found so far are visited: a move
    needs a rank whose score is at most ``B - min(item sizes)``; a swap partner
    on rank ``r`` has its value in the worst rank's dominant dimension in
    ``[s_k - (B - L_r), s_k - (W - B)]`` (``L_r`` the rank's load there), so
    ranks with ``L_r > 2B - W`` are skipped and the rest are searched by
    bisection in per-rank sorted lists. A first pass probes each rank's
    partner nearest the ideal value to make ``B`` small early. Exact: every
    candidate reaching the final ``B`` is visited.
    """
    n = loads.n
    tb, tc = loads.tb, loads.tc
    xs = {k: g[0] for k, g in gkey.items()}
    ys = {k: g[1] for k, g in gkey.items()}
    # each rank's kinds sorted by scaled bytes and by scaled NS cost
    sorted_x = [sorted(g) for g in groups]
    sorted_y = [sorted((y, x, d) for x, y, d in g) for g in groups]
    # the first field of those lists alone: bisected on plain ints
    vals_x = [[t[0] for t in lst] for lst in sorted_x]
    vals_y = [[t[0] for t in lst] for lst in sorted_y]

    free = all(a is None for a in allowed_of.values())  # no capped class

    # scaled loads per rank, and the ranks sorted by each (load, rank): kept
    # up to date by relocate instead of rebuilt every round
    xl = [b * tc for b in loads.b]
    yl = [c * tb for c in loads.c]
    rank_x = sorted((v, r) for r, v in enumerate(xl))
    rank_y = sorted((v, r) for r, v in enumerate(yl))

    def shift(r: int, dx: int, dy: int) -> None:
        for lst, vals, dv in ((rank_x, xl, dx), (rank_y, yl, dy)):
            if dv:
                del lst[bisect.bisect_left(lst, (vals[r], r))]
                vals[r] += dv
                bisect.insort(lst, (vals[r], r))

    def relocate(k: str, src: int, dst: int) -> None:
        loads.add(src, -bts[k], -nss[k])
        loads.add(dst, bts[k], nss[k])
        shift(src, -xs[k], -ys[k])
        shift(dst, xs[k], ys[k])
        owner[k] = dst
        g = gkey[k]
        names = groups[src][g]
        del names[bisect.bisect_left(names, k)]
        if not names:
            del groups[src][g]
            i = bisect.bisect_left(sorted_x[src], g)
            del sorted_x[src][i], vals_x[src][i]
            gy = (g[1], g[0], g[2])
            i = bisect.bisect_left(sorted_y[src], gy)
            del sorted_y[src][i], vals_y[src][i]
        if g in groups[dst]:
            bisect.insort(groups[dst][g], k)
        else:
            groups[dst][g] = [k]
            i = bisect.bisect_left(sorted_x[dst], g)
            sorted_x[dst].insert(i, g)
            vals_x[dst].insert(i, g[0])
            gy = (g[1], g[0], g[2])
            i = bisect.bisect_left(sorted_y[dst], gy)
            sorted_y[dst].insert(i, gy)
            vals_y[dst].insert(i, g[1])

    for _ in range(max_iters):
        worst = loads.worst_rank()
        W = loads.score(worst)
        if loads.b[worst] * tc == W:  # bytes decide the worst rank's score
            sizes, per_rank, per_vals, swap_xy = xs, sorted_x, vals_x, False
            load_of, by_load = xl, rank_x
        else:
            sizes, per_rank, per_vals, swap_xy = ys, sorted_y, vals_y, True
            load_of, by_load = yl, rank_y
        mine = sorted((names[0] for names in groups[worst].values()),
                      key=lambda k: (-(xs[k] + ys[k]), k))
        best = None  # (new pair max, kind, k, rank pos, partner)
        B = W  # best pair score so far (a candidate needs new < W, ties kept)
        pref = loads.pref
        xw, yw = xl[worst], yl[worst]

        by_score = loads.by_score
        for k in mine:  # moves k -> r
            xk, yk = xs[k], ys[k]
            after = max(xw - xk, yw - yk)
            if after > B:  # the worst rank alone already ends above the best
                continue
            allowed_k = allowed_of[dtype_of[k]]
            # (by_score holds (score, -rank_order position, rank))
            stop = bisect.bisect_right(by_score, (B - min(xk, yk), 1))
            for i in range(stop):
                r = by_score[i][2]
                if r == worst or not (allowed_k is None or r in allowed_k):
                    continue
                new = max(after, xl[r] + xk, yl[r] + yk)
                if new < W:
                    cand = (new, 0, k, pref[r], "")
                    if best is None or cand < best:
                        best, B = cand, new

        # a swap keeps the pair's sum in each dimension, so the new pair
        # score is at least half of it: ranks above 2B - W (dominant) or
        # 2B - (other load of the worst) are out of reach
        if swap_xy:
            other_of, ow = xl, xw
        else:
            other_of, ow = yl, yw
        # dtypes the worst rank may take back (capped classes keep their owners)
        host_ok = None if free else {d for d, a in allowed_of.items()
                                     if a is None or worst in a}
        # ascending load, ties by rank id
        ranks = [r for _, r in by_load if r != worst]
        # per matrix of the worst rank: what every rank's check needs
        swappable = []
        for k in mine:
            xk, yk = xs[k], ys[k]
            xw_k, yw_k = xw - xk, yw - yk  # the worst rank without k
            ok = xk if swap_xy else yk  # k in the other dimension
            swappable.append((k, xk, yk, sizes[k], xk + yk, xw_k, yw_k, ok, ow - ok,
                              allowed_of[dtype_of[k]]))
        for probe in (True, False):
            # the probe pass tries, on the least loaded ranks, the partner
            # nearest the value that evens the pair, so B drops early
            scan = ranks[:_PROBE_RANKS] if probe else ranks
            live_at = None
            for r in scan:
                if live_at != B:  # B dropped: forget k that cannot reach it
                    live = [t for t in swappable if t[5] <= B and t[6] <= B]
                    live_at = B
                lr = load_of[r]
                if lr > 2 * B - W:
                    break
                o_r = other_of[r]
                if o_r > 2 * B - ow:
                    continue
                lst = per_rank[r]
                vals = per_vals[r]
                xr, yr = xl[r], yl[r]
                for k, xk, yk, sk, size_k, xw_k, yw_k, ok, ow_k, allowed_k in live:
                    # (partners only add to the worst rank: a k leaving it
                    # above B is out, and B only drops within a rank's loop)
                    if not (allowed_k is None or r in allowed_k):
                        continue
                    if probe:
                        mid = bisect.bisect_left(vals, sk - (W - lr) // 2)
                        lo, hi = max(0, mid - 1), min(len(vals), mid + 1)
                    else:
                        lo = bisect.bisect_left(vals, sk - (B - lr))
                        hi = bisect.bisect_left(vals, sk - (W - B) + 1, lo)
                    if lo >= hi:
                        continue
                    xr_k, yr_k = xr + xk, yr + yk  # rank r with k
                    # the partner's other-dimension value must keep both
                    # ranks at or below B there
                    q_lo = o_r + ok - B
                    q_hi = B - ow_k
                    for i in range(lo, hi):
                        a, q, d = lst[i]
                        if q < q_lo or q > q_hi:
                            continue
                        if swap_xy:
                            xj, yj = q, a
                        else:
                            xj, yj = a, q
                        if xj + yj >= size_k:
                            continue
                        if host_ok is not None and d not in host_ok:
                            continue
                        new = max(xw_k + xj, yw_k + yj, xr_k - xj, yr_k - yj)
                        if new < W:
                            j = groups[r][(xj, yj, d)][0]
                            cand = (new, 1, k, pref[r], j)
                            if best is None or cand < best:
                                best, B = cand, new
        if best is None:
            return
        _, kind, k, rpos, j = best
        r = order[rpos]
        relocate(k, worst, r)
        if kind == 1:
            relocate(j, r, worst)
