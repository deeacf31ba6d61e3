"""The ``lightning-rec`` command. ``lightning-rec plan tables.yaml --world-size 512 ...`` plans a cluster
(``--speeds speeds.json``: with speeds measured by ``lightning-rec profile``, on the job's own data).
``lightning-rec export CKPT_DIR --quantize int8 -o model.pt`` writes a checkpoint's model, tables quantized
(``--program -o model.pt2``: a ``torch.export`` program that serves with torch alone).

The table file (YAML or JSON) holds a list of tables, or a mapping with ``tables`` and optional
``together`` (lists of table names placed together)::

    tables:
      - name: user
        num_embeddings: 100000000
        embedding_dim: 128
        feature_names: [user_id]
        pooling_factors: {user_id: 1}     # optional, ids per sample; or pooling_factor: 20 for all features
        dtype: float16                     # optional
        pooling: mean                      # optional (sum)
        sharding_types: [row_wise, table_row_wise]   # optional constraint
        placement: {sharding_type: table_wise, ranks: [0]}   # optional fixed placement
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_rec.checkpoint import atomic
from lightning_rec.configs import EmbeddingBagConfig, EmbeddingConfig
from lightning_rec.data import convert
from lightning_rec.export import export_program
from lightning_rec.lightning.rec_module import RecModule
from lightning_rec.plans.kinds import ParameterSharding, kind_of
from lightning_rec.plans.planner import OPTIMIZER_STATE, Planner, PlannerError, TableConstraint, Topology
from lightning_rec.plans.planner.profile_cmd import add_parser as add_profile_parser
from lightning_rec.plans.planner.profile_cmd import command as profile_command
from lightning_rec.quant import EmbeddingBagCollection as QuantEmbeddingBagCollection
from lightning_rec.quant import EmbeddingCollection as QuantEmbeddingCollection
from lightning_rec.quant import load_quantized
from lightning_rec.testing import run_distributed

_TABLE_KEYS = {
    "name",
    "num_embeddings",
    "embedding_dim",
    "feature_names",
    "dtype",
    "pooling",
    "pooling_factor",
    "pooling_factors",
    "sharding_types",
    "placement",
    "allow_host_memory",
    "sequence",
}


class TableFileError(ValueError):
    """A table file that cannot be read; the message names the file, the line and the table."""


class CliError(Exception):
    """A command-line argument that cannot be used (e.g. an output path); the message names it."""


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _plain(node: yaml.Node) -> Any:
    return yaml.safe_load(yaml.serialize(node))


def load_tables(path: str | Path) -> tuple[list, dict[str, float], dict[str, TableConstraint], list[list[str]]]:
    """Read a table file: (configs, pooling factors by feature, constraints by table, together groups)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TableFileError(f"cannot read table file {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TableFileError(f"{path}: not a YAML or JSON text file (byte {e.start} is not UTF-8)") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # JSON reads as YAML too, with line numbers
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise TableFileError(f"{path}{where}: not valid YAML/JSON: {getattr(e, 'problem', e)}") from None
    together: list[list[str]] = []
    if isinstance(root, yaml.MappingNode):
        keys = {k.value: v for k, v in root.value}
        unknown = sorted(set(keys) - {"tables", "together"})
        if unknown or "tables" not in keys:
            raise TableFileError(
                f"{path} line {_line(root)}: expected keys 'tables' (and optionally 'together'), found {sorted(keys)}"
            )
        if "together" in keys:
            together = _plain(keys["together"])
            if not isinstance(together, list) or not all(isinstance(g, list) for g in together):
                raise TableFileError(
                    f"{path} line {_line(keys['together'])}: 'together' must be a list of lists of table names"
                )
        root = keys["tables"]
    if not isinstance(root, yaml.SequenceNode) or not root.value:
        raise TableFileError(f"{path}: expected a non-empty list of tables (or a mapping with 'tables')")
    configs: list[EmbeddingBagConfig | EmbeddingConfig] = []
    pooling: dict[str, float] = {}
    constraints: dict[str, TableConstraint] = {}
    for node in root.value:
        where = f"{path} line {_line(node)}"
        spec = _plain(node)
        if not isinstance(spec, dict):
            raise TableFileError(f"{where}: each table must be a mapping, got {spec!r}")
        label = f"table {spec.get('name')!r}" if "name" in spec else "a table without a name"
        placement = spec.get("placement")
        unknown = sorted(set(spec) - _TABLE_KEYS)
        if unknown:
            raise TableFileError(f"{where}, {label}: unknown keys {unknown}; known keys: {sorted(_TABLE_KEYS)}")
        missing = [k for k in ("name", "num_embeddings", "embedding_dim", "feature_names") if k not in spec]
        if missing:
            raise TableFileError(f"{where}, {label}: missing {missing}")
        try:
            kw = {
                k: spec[k]
                for k in ("name", "num_embeddings", "embedding_dim", "feature_names", "dtype", "pooling")
                if k in spec
            }
            if isinstance(kw["feature_names"], str):
                raise ValueError(f"feature_names must be a list, got {kw['feature_names']!r}")
            cfg = (EmbeddingConfig if spec.get("sequence") else EmbeddingBagConfig)(**kw)
            for k in ("num_embeddings", "embedding_dim"):
                if getattr(cfg, k) >= 2**63:
                    raise ValueError(f"{k}={getattr(cfg, k)} is larger than the largest tensor size, 2**63 - 1")
            if any(c.name == cfg.name for c in configs):
                raise ValueError("the name is used by an earlier table")
            factors = spec.get("pooling_factors") or {}
            if "pooling_factor" in spec:
                factors = dict.fromkeys(cfg.feature_names, spec["pooling_factor"]) | factors
            if not isinstance(factors, dict) or set(factors) - set(cfg.feature_names):
                raise ValueError(
                    f"pooling_factors must map this table's features {cfg.feature_names} to ids per "
                    f"sample, got {factors!r}"
                )
            pooling.update(factors)
            if "sharding_types" in spec or "placement" in spec or "allow_host_memory" in spec:
                if placement is not None:
                    placement = _placement(placement)
                types = spec.get("sharding_types")
                if types is not None:
                    types = [ParameterSharding(t).sharding_type for t in types]
                constraints[cfg.name] = TableConstraint(types, placement, bool(spec.get("allow_host_memory", True)))
        except (TypeError, ValueError) as e:
            msg = str(e)
            # the config's own messages already name the table
            raise TableFileError(f"{where}: {msg}" if msg.startswith(label) else f"{where}, {label}: {msg}") from None
        configs.append(cfg)
    return configs, pooling, constraints, together


def _placement(spec: object) -> ParameterSharding:
    """A fixed placement from the file: ``sharding_type`` and the fields that type accepts."""
    if not isinstance(spec, dict) or "sharding_type" not in spec:
        raise ValueError(f"placement must be a mapping with sharding_type, got {spec!r}")
    kind = kind_of(spec["sharding_type"])
    accepted = {"sharding_type", "compute_kernel", *kind.fields}
    unknown = sorted(set(spec) - accepted)
    if unknown:
        raise ValueError(
            f"placement keys {unknown} do not apply to {kind.sharding_type.value}; it takes "
            f"{sorted(accepted - {'sharding_type'})}"
        )
    for k in kind.fields:
        if k in spec and not isinstance(spec[k], list):
            raise ValueError(f"placement {k} must be a list of integers, got {spec[k]!r}")
    return ParameterSharding(**spec)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lightning-rec", description="lightning_rec tools")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan the sharding of a table file for a cluster layout and print estimates")
    p.add_argument("tables", help="YAML or JSON file of table configs")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--model-parallel-size", type=int, help="ranks per model-parallel group (default: world size)")
    p.add_argument("--local-size", type=int, help="ranks per host (default: the model-parallel group)")
    p.add_argument("--device-memory", help="per rank, e.g. 80GB (default: unlimited)")
    p.add_argument("--host-memory", help="per host, for tables kept in host memory, e.g. 1TB")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--backend", choices=("gloo", "nccl"))
    p.add_argument(
        "--host-link",
        metavar="SPEED",
        help="each host's link to the other hosts, per direction, shared by its ranks: 1gbit, 100Gb/s, 12.5GB/s "
        "(default: the device's inter-host speed)",
    )
    p.add_argument(
        "--replicas-within-host",
        action="store_true",
        help="2D arrangement: each host holds whole replica groups and each model-parallel group spreads over the "
        "hosts (--local-size: that group's ranks per host); default: model parallel within a host",
    )
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank per step")
    p.add_argument("--pooling-factor", type=float, default=1.0, help="ids per sample of features the file leaves out")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE), default="sgd")
    p.add_argument("--gradients", choices=("dense", "sparse", "fused"), default="sparse")
    p.add_argument("--min-column-width", type=int, default=32)
    p.add_argument("--json", metavar="FILE", help="also write the plan and estimates as JSON ('-' for stdout only)")
    p.add_argument(
        "--speeds",
        metavar="FILE",
        help="speeds measured on the job's own data (lightning-rec profile); default: the device's default speeds",
    )
    add_profile_parser(sub)
    convert.add_parser(sub)
    _export_parser(sub)
    return ap


_STORAGE = ("int8", "int4", "int2", "fp16", "fp32")
_OUTPUT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint directory's model as one state_dict file or a torch.export program (--program), "
        "embedding tables quantized (--quantize)",
        description="Reads a checkpoint directory (any plan and world size) in this process. The state_dict file "
        "loads with torch.load into the model quantized the same way: "
        "quantize_embeddings(Model(...), dtype).load_state_dict(torch.load(FILE)). With --program the file is a "
        "torch.export program (.pt2) that serves with torch alone: torch.export.load(FILE).module()(dense, values, "
        "lengths) (without dense when the model has no num_dense attribute).",
    )
    p.add_argument("checkpoint", help="checkpoint directory (Trainer(strategy='rec_sharded') or checkpoint.save)")
    p.add_argument(
        "-o", "--output", required=True, help="the file to write (torch.save format, or .pt2 with --program)"
    )
    p.add_argument(
        "--program",
        action="store_true",
        help="write a torch.export program (lightning_rec.export.export_program) instead of a state_dict",
    )
    p.add_argument(
        "--model",
        default="lightning_rec.models.DLRM",
        help="the RecModule class built from the saved hyper-parameters: package.module.Class or "
        "package.module:Class (default: %(default)s)",
    )
    p.add_argument("--quantize", choices=_STORAGE, help="store every embedding table as this type (default: float)")
    p.add_argument(
        "--table-dtype", action="append", default=[], metavar="TABLE=TYPE", help="one table's type (repeatable)"
    )
    p.add_argument("--output-dtype", choices=sorted(_OUTPUT), default="fp32", help="the collections' outputs")
    p.add_argument(
        "--row-alignment",
        type=int,
        default=None,
        help="pad stored rows to this many bytes (16: fbgemm's and TorchRec's rows); default: compact rows that the "
        "fast CPU lookup reads in place",
    )
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle the checkpoint fully (runs its code)")


def _model_class(spec: str) -> type[RecModule]:
    module, sep, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if sep else None
    except (ImportError, AttributeError) as e:
        raise CliError(f"--model {spec}: cannot import it ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, RecModule)):
        raise CliError(f"--model {spec}: expected a RecModule subclass (package.module.Class), got {cls!r}")
    return cls


def export_command(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if not out.parent.is_dir():
        raise CliError(f"--output {args.output}: the directory {str(out.parent)!r} does not exist")
    per_table = {}
    for item in args.table_dtype:
        name, sep, kind = item.rpartition("=")  # table names may hold "=", the type never does
        if not sep or kind not in _STORAGE:
            raise CliError(f"--table-dtype {item!r}: expected TABLE=TYPE with TYPE one of {list(_STORAGE)}")
        per_table[name] = kind
    if per_table and not args.quantize:
        raise CliError("--table-dtype needs --quantize (the type of the other tables)")
    cls = _model_class(args.model)
    if args.quantize:
        model = load_quantized(
            args.checkpoint,
            cls,
            args.quantize,
            per_table_weight_dtype=per_table,
            output_dtype=_OUTPUT[args.output_dtype],
            row_alignment=args.row_alignment,
            trusted=args.trust_checkpoint,
        )
    else:
        model = cls.load_from_checkpoint(args.checkpoint, trusted_checkpoints=args.trust_checkpoint).eval()
    if args.program:
        # a model with a num_dense attribute is called as model(dense, kjt), any other as model(kjt)
        export_program(model, out, num_dense=getattr(model, "num_dense", None))
    else:
        tmp = atomic.partial_path(out)
        try:
            torch.save(model.state_dict(), tmp)
            os.replace(tmp, out)
        finally:
            atomic.remove(tmp)
    quantized = [m for m in model.modules() if isinstance(m, (QuantEmbeddingBagCollection, QuantEmbeddingCollection))]
    kinds = Counter(t.name for m in quantized for t in m.storage_types().values())
    stored = sum(m.storage_bytes() for m in quantized)
    rows = f": tables {dict(sorted(kinds.items()))}, {stored / 2**20:.1f} MiB of stored rows" if quantized else ""
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB){rows}")
    return 0


def plan_command(args: argparse.Namespace) -> int:
    if args.json not in (None, "-"):
        out = Path(args.json)
        if not out.parent.is_dir():  # say so before planning, not after
            raise CliError(f"--json {args.json}: the directory {str(out.parent)!r} does not exist")
    configs, pooling, constraints, together = load_tables(args.tables)
    topo = Topology(
        args.world_size,
        args.model_parallel_size,
        args.local_size,
        args.device_memory,
        args.host_memory,
        device=args.device,
        backend=args.backend,
        host_link=args.host_link,
        replicas_within_host=args.replicas_within_host,
    )
    planner = Planner(
        topo,
        batch_size=args.batch_size,
        pooling_factors=pooling,
        default_pooling_factor=args.pooling_factor,
        optimizer=args.optimizer,
        gradients=args.gradients,
        constraints=constraints,
        together=together,
        min_column_width=args.min_column_width,
        speeds=args.speeds,
    )
    planner.plan(configs)
    report = planner.explain()
    if planner.speeds is None:  # a profile names itself in the report's settings
        backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
        report.settings["speeds"] = f"defaults ({args.device}/{backend})"
    if args.json == "-":
        json.dump(report.as_dict(), sys.stdout, indent=1)
        print()
        return 0
    print(report)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report.as_dict(), indent=1))
        except OSError as e:
            raise CliError(f"--json {args.json}: cannot write: {e.strerror or e}") from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-rec`` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            return export_command(args)
        if args.command == "profile":
            return profile_command(args, load_tables, run_distributed)
        return convert.command(args) if args.command == "convert" else plan_command(args)
    except (PlannerError, ValueError, TypeError, OSError, CliError) as e:
        print(f"lightning-rec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
