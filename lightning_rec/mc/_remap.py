"""Pure tensor math of managed collision: hashing, buckets, per-step admission and resize plans.

Everything here is a function of its arguments (no process groups, no modules), and every decision is
local to a bucket and independent of the order of the ids in a step, so any rank that sees all ids of a
bucket takes the same decisions a single process takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_HASH_BITS = 40  # bucket hash width: hash * num_buckets must fit in int64
MAX_BUCKETS = 1 << (63 - _HASH_BITS)
# sort keys pack (bucket, flag, value) into one int64: steps and counts saturate at 2**31 - 1 for ordering
_SAT = 1 << 31
MAX_STEPS = _SAT - 1


def _c(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _c(0x9E3779B97F4A7C15), _c(0xBF58476D1CE4E5B9), _c(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    # logical right shift: torch's >> on int64 is arithmetic
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping arithmetic): a well-mixed 64-bit hash of each value."""
    z = x.to(torch.int64) + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def bucket_of(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket of each raw id: ``floor(hash40(id) * num_buckets / 2**40)``.

    Range bucketing (not ``hash % n``) makes bucket ``b`` of ``n`` the union of buckets ``k*b .. k*b+k-1``
    of ``k*n``: doubling or halving the bucket count keeps every id inside its old row range.
    """
    h = _srl(splitmix64(ids), 64 - _HASH_BITS)
    return (h * num_buckets) >> _HASH_BITS


def hashed_uniform(ids: torch.Tensor, dim: int, seed: int, low: float, high: float) -> torch.Tensor:
    """``[len(ids), dim]`` float32 values in ``[low, high)``, a pure function of (seed, id, column).

    Used to re-initialise a row when an id takes it: any rank computes the same values as one process.
    """
    base = splitmix64(ids.to(torch.int64) ^ seed)
    cols = torch.arange(dim, dtype=torch.int64) * _GOLDEN
    u = _srl(splitmix64(base[:, None] + cols), 40).to(torch.float32) / float(1 << 24)  # 24 bits: exact in fp32
    return low + (high - low) * u


def hashed_uniform_rows(
    ids: torch.Tensor, dim: int, seeds: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float
) -> torch.Tensor:
    """``hashed_uniform`` of several tables at once: row ``i`` uses ``seeds[i]``, ``low[i]``, ``high[i]`` (float64
    tensors, or one float for every row).

    Bit for bit what ``hashed_uniform`` gives each table: the float32 arithmetic on the same float32-rounded
    ``low`` and ``high - low`` (torch rounds a Python scalar to the tensor's dtype).
    """
    base = splitmix64(ids.to(torch.int64) ^ seeds)
    cols = torch.arange(dim, dtype=torch.int64) * _GOLDEN
    u = _srl(splitmix64(base[:, None] + cols), 40).to(torch.float32) / float(1 << 24)
    if not torch.is_tensor(low):
        return low + (high - low) * u
    return low.to(torch.float32)[:, None] + (high - low).to(torch.float32)[:, None] * u


def _rank_in_group(sorted_groups: torch.Tensor) -> torch.Tensor:
    """Position of each element within its run of equal values (input sorted by group)."""
    n = sorted_groups.numel()
    idx = torch.arange(n)
    if n == 0:
        return idx
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = sorted_groups[1:] != sorted_groups[:-1]
    # linear, unlike a searchsorted of the array into itself
    return idx - torch.cummax(torch.where(starts, idx, 0), 0).values


def lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """Permutation sorting by ``keys[0]``, then ``keys[1]``, ... (all ascending, stable)."""
    perm = torch.arange(keys[0].numel())
    for k in reversed(keys):
        perm = perm[torch.sort(k[perm], stable=True).indices]
    return perm


@dataclass
class StepResult:
    """What one step of remapping did (slots are rows of the table)."""

    slots: torch.Tensor  # remapped row of every input id, input order
    admitted_slots: torch.Tensor  # rows that took a new id this step (re-initialise them)
    admitted_ids: torch.Tensor  # the ids that took them
    lookups: int
    hits: int  # ids (with repeats) that already held a row
    evicted: int  # ids that lost their row this step
    unadmitted: int  # distinct new ids that found no row (mapped to a shared fallback row of their bucket)


class SlotIndex:
    """Sorted (raw id -> slot) index over the occupied slots; derived state, rebuilt after a load."""

    def __init__(self, raw_ids: torch.Tensor) -> None:
        occ = (raw_ids >= 0).nonzero().flatten()
        keys, order = torch.sort(raw_ids[occ])
        self.keys, self.slots = keys, occ[order]

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where absent."""
        if self.keys.numel() == 0:
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(self.keys, ids).clamp_(max=self.keys.numel() - 1)
        return torch.where(self.keys[pos] == ids, self.slots[pos], -1)

    def update(self, removed_slots: torch.Tensor, new_ids: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Drop the entries of ``removed_slots`` and insert (new_ids, new_slots); O(table) copy, no full sort."""
        if removed_slots.numel():
            gone = torch.zeros(int(self.slots.max()) + 1 if self.slots.numel() else 1, dtype=torch.bool)
            gone[removed_slots[removed_slots < gone.numel()]] = True
            keep = ~gone[self.slots]
            self.keys, self.slots = self.keys[keep], self.slots[keep]
        if new_ids.numel():
            nk, order = torch.sort(new_ids)
            ns = new_slots[order]
            pos = torch.searchsorted(self.keys, nk) + torch.arange(nk.numel())
            n = self.keys.numel() + nk.numel()
            is_new = torch.zeros(n, dtype=torch.bool)
            is_new[pos] = True
            keys, slots = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
            keys[is_new], slots[is_new] = nk, ns
            keys[~is_new], slots[~is_new] = self.keys, self.slots
            self.keys, self.slots = keys, slots


def remap_step(
    ids: torch.Tensor,
    raw_ids: torch.Tensor,
    last_access: torch.Tensor,
    counts: torch.Tensor,
    index: SlotIndex,
    num_buckets: int,
    step: int,
    policy: str,
    update: bool = True,
) -> StepResult:
    """Remap one step's ids in place of the state tensors (``raw_ids``, ``last_access``, ``counts``).

    The modules run these rules for all tables at once (``_batch.remap_batch``); this one-table version is
    their reference (tests, benchmarks).

    With ``update=False`` (evaluation) nothing changes: known ids get their rows, new ids the fallback row.

    Rules (per bucket, independent of id order):
      * an id that holds a row keeps it: last access := step, count += its occurrences;
      * new ids, best first (more occurrences this step, then smaller id), take rows in eviction order:
        empty rows (lowest first), then rows not touched this step by the policy's score
        (LRU: oldest access; LFU: smallest count (saturating at 2**31 - 1), then oldest access; ties:
        lowest row);
      * LRU always admits while rows remain; LFU evicts an id only for a new id seen more often this step
        than the evicted id's total count;
      * a new id left without a row maps to a fallback row of its bucket (``hash(id) % bucket size``)
        and gets no state: it shares that row until it is admitted.
    """
    zch = raw_ids.numel()
    bs = zch // num_buckets
    n = ids.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return StepResult(empty, empty, empty, 0, 0, 0, 0)
    uniq, inverse, occ = torch.unique(ids, return_inverse=True, return_counts=True)
    slot = index.find(uniq)
    hit = slot >= 0
    hs = slot[hit]
    miss = uniq[~hit]
    miss_occ = occ[~hit]
    admitted_slots = admitted_ids = torch.zeros(0, dtype=torch.int64)
    evicted = 0
    if not update:
        if miss.numel():
            slot = slot.clone()
            slot[~hit] = bucket_of(miss, num_buckets) * bs + splitmix64(miss).remainder(bs)
        return StepResult(slot[inverse], admitted_slots, admitted_ids, n, int(occ[hit].sum()), 0, int(miss.numel()))
    last_access[hs] = step
    counts[hs] += occ[hit]
    if miss.numel():
        mb = bucket_of(miss, num_buckets)
        # one stable sort on (bucket, -occurrences); ``miss`` is ascending already (from unique)
        morder = torch.sort(mb * _SAT + (_SAT - 1 - miss_occ.clamp(max=_SAT - 1)), stable=True).indices
        miss, miss_occ, mb = miss[morder], miss_occ[morder], mb[morder]
        mrank = _rank_in_group(mb)
        # candidate rows: every row of the buckets with new ids, minus the rows hit this step
        buckets = torch.unique(mb)
        rows = (buckets[:, None] * bs + torch.arange(bs)).flatten()
        touched = torch.zeros(zch, dtype=torch.bool)
        touched[hs] = True
        rows = rows[~touched[rows]]
        rb = rows // bs
        occupied = (raw_ids[rows] >= 0).to(torch.int64)
        # stable sorts on packed keys; ``rows`` is ascending, which breaks the remaining ties
        if policy == "lru":
            rorder = torch.sort((rb * 2 + occupied) * _SAT + last_access[rows], stable=True).indices
        else:
            inner = torch.sort(counts[rows].clamp(max=_SAT - 1) * _SAT + last_access[rows], stable=True).indices
            rorder = inner[torch.sort((rb * 2 + occupied)[inner], stable=True).indices]
        rows, rb = rows[rorder], rb[rorder]
        rrank = _rank_in_group(rb)
        # pair the k-th new id of a bucket with the k-th candidate row of that bucket
        rkey = rb * bs + rrank
        mkey = mb * bs + mrank.clamp(max=bs - 1)
        pos = torch.searchsorted(rkey, mkey).clamp(max=max(rkey.numel() - 1, 0))
        paired = (mrank < bs) & (rkey.numel() > 0)
        if rkey.numel():
            paired &= rkey[pos] == mkey
        target = torch.where(paired, rows[pos] if rkey.numel() else mkey, -1)
        if policy == "lfu":
            tgt = target.clamp(min=0)
            free = raw_ids[tgt] < 0
            paired &= free | (miss_occ > counts[tgt])
        adm_slots, adm_ids, adm_occ = target[paired], miss[paired], miss_occ[paired]
        old = raw_ids[adm_slots]
        evicted = int((old >= 0).sum())
        index.update(adm_slots[old >= 0], adm_ids, adm_slots)
        raw_ids[adm_slots] = adm_ids
        last_access[adm_slots] = step
        counts[adm_slots] = adm_occ
        fallback = mb * bs + splitmix64(miss).remainder(bs)
        miss_slot = torch.where(paired, target, fallback)
        slot = slot.clone()
        slot[(~hit).nonzero().flatten()[morder]] = miss_slot
        admitted_slots, admitted_ids = adm_slots, adm_ids
    return StepResult(
        slots=slot[inverse],
        admitted_slots=admitted_slots,
        admitted_ids=admitted_ids,
        lookups=n,
        hits=int(occ[hit].sum()),
        evicted=evicted,
        unadmitted=int(miss.numel() - admitted_ids.numel()),
    )


def resize_plan(
    raw_ids: torch.Tensor,
    last_access: torch.Tensor,
    counts: torch.Tensor,
    new_buckets: int,
    policy: str,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each surviving id goes when the bucket count changes (the table size stays).

    Returns ``(src, dst, evicted)``: the id (and its row, metadata, optimizer state) at row ``src[i]``
    moves to row ``dst[i]``; rows not in ``dst`` end empty. Bucket counts must divide each other, so a
    new bucket lies inside one old bucket (split) or covers whole old buckets (merge). An id that still
    fits keeps its row when the row lies in its new bucket, else takes the lowest free row there; when a
    split leaves more ids than rows in a half, the policy keeps the most recent (LRU) or most frequent
    (LFU, then most recent) ids, ties to the lower row.
    """
    zch = raw_ids.numel()
    bs = zch // new_buckets
    occ = (raw_ids >= 0).nonzero().flatten()
    nb = bucket_of(raw_ids[occ], new_buckets)
    if policy == "lru":
        order = lexsort(nb, -last_access[occ], occ)
    else:
        order = lexsort(nb, -counts[occ], -last_access[occ], occ)
    occ, nb = occ[order], nb[order]
    keep = _rank_in_group(nb) < bs
    evicted = int((~keep).sum())
    occ, nb = occ[keep], nb[keep]
    in_place = (occ // bs) == nb
    src_stay = occ[in_place]
    movers, mover_b = occ[~in_place], nb[~in_place]
    taken = torch.zeros(zch, dtype=torch.bool)
    taken[src_stay] = True
    mo = lexsort(mover_b, movers)
    movers, mover_b = movers[mo], mover_b[mo]
    if movers.numel():
        buckets = torch.unique(mover_b)
        rows = (buckets[:, None] * bs + torch.arange(bs)).flatten()
        rows = rows[~taken[rows]]
        rb = rows // bs
        rkey = rb * bs + _rank_in_group(rb)
        mkey = mover_b * bs + _rank_in_group(mover_b)
        dst_move = rows[torch.searchsorted(rkey, mkey)]
    else:
        dst_move = movers
    return torch.cat([src_stay, movers]), torch.cat([src_stay, dst_move]), evicted
