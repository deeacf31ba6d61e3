"""Ranks agree on what they shard before anything else travels.

Every rank of a job must build the same tables with the same resolved shard layout: a rank that resolved
another plan would send ids another rank does not expect (a wrong answer) or wait in a collective the
others never join (a hang). The environment variables that choose collectives (:func:`settings`) must match
too, for the same reason. :func:`check_agreement` compares one small fixed-size digest per rank (one
all-gather, which also carries each rank's device for ShardedTensor placements) and, only when they
differ, exchanges the per-table descriptions and settings to name the tables, variables and ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline import output_dist
from lightning_rec.plans.shard_geometry import ShardMeta

_DEVICE_TYPES = ("cpu", "cuda")


def describe_table(t: BaseEmbeddingConfig, shards: Sequence[ShardMeta] | None) -> str:
    """A canonical text of one table's config and resolved layout (equal on ranks that agree)."""
    pooling = getattr(t, "pooling", None)
    layout = (
        "data_parallel" if shards is None else [(s.row_offset, s.rows, s.col_offset, s.cols, s.rank) for s in shards]
    )
    return (
        f"rows={t.num_embeddings} dim={t.embedding_dim} features={list(t.feature_names)} "
        f"pooling={getattr(pooling, 'value', pooling)} dtype={t.dtype} shards={layout}"
    )


def settings() -> dict[str, str]:
    """``{variable: resolved value}`` of the environment variables that choose which collectives a sharded
    collection runs; raises naming the variable and its accepted values where one holds another value."""
    return {output_dist.ENV: output_dist.mode_from_env(), transport.PAIRWISE_ENV: transport.pairwise_mode()}


def agreement_text(tables: Mapping[tuple[str, str], str], options: str, env: Mapping[str, str]) -> str:
    """What ranks compare (its digest): equal exactly when tables, options and settings are."""
    return (
        options
        + "\n"
        + "\n".join(f"{k!r}: {v}" for k, v in sorted(tables.items()))
        + "\n"
        + " ".join(f"{k}={v!r}" for k, v in sorted(env.items()))
    )


def _digest(text: str) -> list[int]:
    raw = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)]


def _encode_device(device: torch.device) -> list[int]:
    kind = _DEVICE_TYPES.index(device.type) if device.type in _DEVICE_TYPES else len(_DEVICE_TYPES)
    return [kind, -1 if device.index is None else device.index]


def _decode_device(kind: int, index: int, fallback: torch.device) -> torch.device:
    if kind >= len(_DEVICE_TYPES):
        return fallback
    return torch.device(_DEVICE_TYPES[kind]) if index < 0 else torch.device(_DEVICE_TYPES[kind], index)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def check_agreement(
    tables: dict[tuple[str, str], str],
    options: str,
    error: Exception | None,
    group: dist.ProcessGroup,
    device: torch.device,
    collective_device: torch.device | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[int, torch.device]:
    """Raise on every rank unless all ranks of ``group`` hold the same ``tables``, ``options`` and ``env``.

    ``tables``: ``{(collection path, table name): describe_table(...)}``; ``options``: anything else that
    must match (sharding arguments); ``env``: :func:`settings`; ``error``: this rank's own failure to resolve
    its plan or settings, if any (the others then raise too instead of waiting). Returns ``{global rank: the
    device its shards live on}``.
    """
    env = dict(env or {})
    mine = [int(error is not None), *_digest(agreement_text(tables, options, env)), *_encode_device(device)]
    ranks = dist.get_process_group_ranks(group)
    rows = dict(zip(ranks, comm.all_gather_ints(mine, group, device=collective_device)))
    failed = sorted(r for r, row in rows.items() if row[0])
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"shard_modules: {_ranks(failed)} could not resolve the sharding plan or its environment "
            "settings (see the error raised there); stopping this rank too"
        )
    digests: dict[tuple[int, ...], list[int]] = {}
    for r, row in rows.items():
        digests.setdefault(tuple(row[1:3]), []).append(r)
    if len(digests) > 1:
        everyone: list = [None] * len(ranks)
        dist.all_gather_object(everyone, (tables, options, env), group=group)
        raise ValueError(_mismatch_message(dict(zip(ranks, everyone))))
    return {r: _decode_device(row[3], row[4], device) for r, row in rows.items()}


def _mismatch_message(by_rank: dict[int, tuple[dict, str, dict]]) -> str:
    """Every table, option and setting on which ``{rank: (tables, options, settings)}`` differ, naming ranks."""
    lines = _setting_lines(by_rank)
    keys = sorted({k for tables, _, _ in by_rank.values() for k in tables})
    for key in keys:
        seen: dict[str, list[int]] = {}
        for r, (tables, _, _) in by_rank.items():
            seen.setdefault(tables.get(key, "<no such table>"), []).append(r)
        if len(seen) > 1:
            path, name = key
            where = f"table {name!r}" + (f" of collection {path!r}" if path else "")
            detail = "; ".join(f"{_ranks(rs)}: {desc}" for desc, rs in seen.items())
            lines.append(f"{where} differs across ranks ({detail})")
    options: dict[str, list[int]] = {}
    for r, (_, opts, _) in by_rank.items():
        options.setdefault(opts, []).append(r)
    if len(options) > 1:
        lines.append("sharding options differ (" + "; ".join(f"{_ranks(rs)}: {o}" for o, rs in options.items()) + ")")
    return (
        "shard_modules: the ranks disagree on what to shard, so they would exchange mismatched data; every rank "
        "must pass the same tables and plan and set the same environment. " + " ".join(lines)
    )


def _setting_lines(by_rank: dict[int, tuple[dict, str, dict]]) -> list[str]:
    lines = []
    for name in sorted({k for _, _, env in by_rank.values() for k in env}):
        seen: dict[str, list[int]] = {}
        for r, (_, _, env) in by_rank.items():
            seen.setdefault(env.get(name, "<unset>"), []).append(r)
        if len(seen) > 1:
            has = ", ".join(f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {v!r}" for v, rs in seen.items())
            lines.append(f"{name}: {has}: set it alike on every rank.")
    return lines
