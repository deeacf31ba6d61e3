"""One remapping pass over every table of a collection (the per-table rules of ``_remap.remap_step``).

Remapping one table costs a few dozen small tensor ops whatever the batch, so a collection of 26 tables paid
that fixed cost 26 times per step. Here the tables share one global row space (table ``t``'s rows start at
``row_offset[t]``) and one global bucket space (``bucket_offset[t]``); the admission pass (order the new ids,
order the candidate rows, pair them, check LFU's rule) runs once over all tables. Only what is stored per
table is touched per table: the unique ids and the sorted index probe, the hits' metadata, the admitted
rows. Decisions are those of ``remap_step`` table by table, bit for bit: every sort key starts with the
global bucket, which orders tables first, and the remaining keys and tie-breaks are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_rec.mc._remap import _SAT, SlotIndex, StepResult, _rank_in_group, _srl, splitmix64

_HASH_BITS = 40


@dataclass
class TableState:
    """One table's remap state (tensors are updated in place)."""

    raw_ids: torch.Tensor
    last_access: torch.Tensor
    counts: torch.Tensor
    index: SlotIndex
    num_buckets: int
    step: int
    lfu: bool


def _segments(sizes: list[int]) -> torch.Tensor:
    """The segment of each element, for consecutive segments of ``sizes``."""
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.int64))


def _per(values: list[int], table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | int:
    """``table[idx]`` (a per-table constant for each element), or the constant itself when all tables share it."""
    return values[0] if len(set(values)) == 1 else table[idx]


def _cat(pieces: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    # one piece (one table): no copy
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else empty


def remap_batch(ids: list[torch.Tensor], tables: list[TableState], update: bool = True) -> list[StepResult]:
    """``[remap_step(ids[t], *tables[t]) for t]`` in one pass: the same slots, admissions and state."""
    nt = len(tables)
    empty = torch.zeros(0, dtype=torch.int64)
    if nt == 0:
        return []
    zch = [s.raw_ids.numel() for s in tables]
    nbs = [s.num_buckets for s in tables]
    bss = [z // b for z, b in zip(zch, nbs)]
    row_off = [0] * nt
    bucket_off = [0] * nt
    for t in range(1, nt):
        row_off[t] = row_off[t - 1] + zch[t - 1]
        bucket_off[t] = bucket_off[t - 1] + nbs[t - 1]
    if sum(nbs) >= _SAT or sum(nbs) * max(bss) >= 1 << 62:
        # packed sort keys: (global bucket, flags, step) and (global bucket, rank) must fit in int64
        raise ValueError(
            f"managed collision: {sum(nbs)} buckets of up to {max(bss)} rows over all tables in one "
            "collection are too many to remap together"
        )
    # per table: unique ids, index probe, hits' metadata (state lives per table)
    uniqs: list[torch.Tensor] = []
    inverses: list[torch.Tensor] = []
    occs: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    hits = [0] * nt
    for t, (v, s) in enumerate(zip(ids, tables)):
        if v.numel() == 0:
            uniqs.append(empty)
            inverses.append(empty)
            occs.append(empty)
            slots.append(empty)
            continue
        u, inv, occ = torch.unique(v, return_inverse=True, return_counts=True)
        sl = s.index.find(u)
        hit = sl >= 0
        hits[t] = int(occ[hit].sum())
        if update:
            hs = sl[hit]
            s.last_access[hs] = s.step
            s.counts[hs] += occ[hit]
        uniqs.append(u)
        inverses.append(inv)
        occs.append(occ)
        slots.append(sl)
    uniq, slot, occ = _cat(uniqs, empty), _cat(slots, empty), _cat(occs, empty)
    tab = _segments([u.numel() for u in uniqs])
    ro = torch.tensor(row_off, dtype=torch.int64)
    bo = torch.tensor(bucket_off, dtype=torch.int64)
    nb_t = torch.tensor(nbs, dtype=torch.int64)
    bs_t = torch.tensor(bss, dtype=torch.int64)
    miss_mask = slot < 0
    miss_pos = miss_mask.nonzero().flatten()
    miss, miss_occ, mtab = uniq[miss_pos], occ[miss_pos], (tab[miss_pos] if nt > 1 else tab[: miss_pos.numel()])
    hmix = splitmix64(miss)
    # per-table constants per id: a plain int where every table has the same (one table: no gathers)
    mbl = (_srl(hmix, 64 - _HASH_BITS) * _per(nbs, nb_t, mtab)) >> _HASH_BITS  # bucket within its table
    mbs = _per(bss, bs_t, mtab)
    fallback = _per(row_off, ro, mtab) + mbl * mbs + hmix.remainder(mbs)  # global row
    gslot = torch.where(miss_mask, -1, slot + _per(row_off, ro, tab))
    adm_rows_g = adm_ids = adm_occ = adm_tab = empty
    evicted = [0] * nt
    unadmitted = torch.bincount(mtab, minlength=nt).tolist()
    if update and miss.numel():
        mb = _per(bucket_off, bo, mtab) + mbl  # global bucket
        morder = torch.sort(mb * _SAT + (_SAT - 1 - miss_occ.clamp(max=_SAT - 1)), stable=True).indices
        miss, miss_occ, mb = miss[morder], miss_occ[morder], mb[morder]
        if nt > 1:
            mtab = mtab[morder]
        if torch.is_tensor(mbs):
            mbs = mbs[morder]
        miss_pos, fallback = miss_pos[morder], fallback[morder]
        mrank = _rank_in_group(mb)
        # candidate rows: every row of the buckets with new ids, minus the rows hit this step, gathered per table
        buckets = torch.unique(mb)
        btab = torch.searchsorted(bo, buckets, right=True) - 1
        bsize = bs_t[btab]
        bstart = ro[btab] + (buckets - bo[btab]) * bsize
        if len(set(bss)) == 1:  # one bucket size: broadcast (cheaper than repeat_interleave)
            rows = (bstart[:, None] + torch.arange(bss[0])).flatten()  # global, ascending
            rb = buckets[:, None].expand(-1, bss[0]).flatten()
        else:
            first = torch.cumsum(bsize, 0) - bsize
            rows = torch.repeat_interleave(bstart - first, bsize) + torch.arange(int(bsize.sum()))
            rb = torch.repeat_interleave(buckets, bsize)
        touched = torch.zeros(sum(zch), dtype=torch.bool)
        touched[gslot[gslot >= 0]] = True
        kp = ~touched[rows]
        rows, rb = rows[kp], rb[kp]
        per_tab = torch.diff(torch.searchsorted(rows, torch.tensor([*row_off, sum(zch)]))).tolist()
        any_lfu = any(s.lfu for s in tables)
        occ_parts: list[torch.Tensor] = []
        la_parts: list[torch.Tensor] = []
        cnt_parts: list[torch.Tensor] = []
        for t, (r, s) in enumerate(zip(torch.split(rows, per_tab), tables)):
            if r.numel() == 0:
                continue
            loc = r - row_off[t] if row_off[t] else r
            occ_parts.append(s.raw_ids[loc] >= 0)
            la_parts.append(s.last_access[loc])
            if any_lfu:
                cnt_parts.append(s.counts[loc] if s.lfu else torch.zeros_like(loc))
        occupied = _cat(occ_parts, empty.bool()).to(torch.int64)
        la = _cat(la_parts, empty)
        # LRU: (bucket, occupied, last access, row); LFU: (bucket, occupied, count, last access, row); the
        # rows are ascending, so stable sorts leave ties to the lower row
        if any_lfu:
            cnt = _cat(cnt_parts, empty)
            inner = torch.sort(cnt.clamp(max=_SAT - 1) * _SAT + la, stable=True).indices
            rorder = inner[torch.sort((rb * 2 + occupied)[inner], stable=True).indices]
            cnt = cnt[rorder]
        else:
            rorder = torch.sort((rb * 2 + occupied) * _SAT + la, stable=True).indices
        rows, rb, occupied = rows[rorder], rb[rorder], occupied[rorder]
        rrank = _rank_in_group(rb)
        # pair the k-th new id of a bucket with the k-th candidate row of that bucket (keys: bucket x widest)
        width = max(bss)
        rkey = rb * width + rrank
        mkey = mb * width + (torch.minimum(mrank, mbs - 1) if torch.is_tensor(mbs) else mrank.clamp(max=mbs - 1))
        paired = mrank < mbs
        if rkey.numel():
            pos = torch.searchsorted(rkey, mkey).clamp(max=rkey.numel() - 1)
            paired &= rkey[pos] == mkey
            target = torch.where(paired, rows[pos], -1)
            lfu_t = torch.tensor([s.lfu for s in tables], dtype=torch.bool)[mtab] if any_lfu else None
            if any_lfu:
                assert lfu_t is not None
                paired &= ~lfu_t | (occupied[pos] == 0) | (miss_occ > cnt[pos])
        else:
            paired &= False
            target = torch.full_like(mkey, -1)
        adm_rows_g, adm_ids, adm_occ, adm_tab = target[paired], miss[paired], miss_occ[paired], mtab[paired]
        gslot[miss_pos] = torch.where(paired, target, fallback)
        unadmitted = (torch.bincount(mtab, minlength=nt) - torch.bincount(adm_tab, minlength=nt)).tolist()
    elif miss.numel():
        gslot[miss_pos] = fallback
    # write the admissions per table (only tables that admitted)
    adm_per_tab = torch.bincount(adm_tab, minlength=nt).tolist() if adm_tab.numel() else [0] * nt
    if nt > 1 and adm_tab.numel():
        adm_order = torch.sort(adm_tab, stable=True).indices
        adm_rows_g, adm_ids, adm_occ = adm_rows_g[adm_order], adm_ids[adm_order], adm_occ[adm_order]
    adm_rows_l, adm_ids_l, adm_occ_l = (torch.split(x, adm_per_tab) for x in (adm_rows_g, adm_ids, adm_occ))
    out = []
    for t, (s, sl, inv, n) in enumerate(
        zip(tables, torch.split(gslot, [u.numel() for u in uniqs]), inverses, adm_per_tab)
    ):
        a_slots, a_ids = empty, empty
        if n:
            a_slots, a_ids = adm_rows_l[t] - row_off[t], adm_ids_l[t]
            old = s.raw_ids[a_slots]
            gone = old >= 0
            evicted[t] = int(gone.sum())
            s.index.update(a_slots[gone], a_ids, a_slots)
            s.raw_ids[a_slots] = a_ids
            s.last_access[a_slots] = s.step
            s.counts[a_slots] = adm_occ_l[t]
        out.append(
            StepResult(
                slots=(sl - row_off[t])[inv] if inv.numel() else empty,
                admitted_slots=a_slots,
                admitted_ids=a_ids,
                lookups=ids[t].numel(),
                hits=hits[t],
                evicted=evicted[t],
                unadmitted=unadmitted[t],
            )
        )
    return out
