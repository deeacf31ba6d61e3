"""LightningCLI: the strategy and a custom plan chosen from YAML."""

from __future__ import annotations

import textwrap

from lightning.pytorch.cli import LightningCLI

from lightning_rec import RecShardedStrategy, ShardingType
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule

YAML = textwrap.dedent("""
    trainer:
      accelerator: cpu
      devices: 2
      max_steps: 2
      logger: false
      enable_checkpointing: false
      enable_progress_bar: false
      enable_model_summary: false
      num_sanity_val_steps: 0
      limit_val_batches: 0
      strategy:
        class_path: lightning_rec.RecShardedStrategy
        init_args:
          embedding_grad: mean
          plan:
            plan:
              ebc:
                user: {sharding_type: row_wise}
                item: {sharding_type: table_wise, ranks: [1]}
                geo: {sharding_type: data_parallel}
""")


def _cli_job(rank: int, ws: int, config: str, extra: list[str]) -> dict:
    cli = LightningCLI(
        ClickModule, run=False, args=["--config", config, *extra], save_config_kwargs={"overwrite": True}
    )
    cli.trainer.fit(cli.model)
    strategy = cli.trainer.strategy
    return {
        "strategy": type(strategy).__name__,
        "grad": getattr(strategy, "embedding_grad", None),
        "params": [n for n, _ in cli.model.named_parameters()],
        "types": {t: ps.sharding_type for t, ps in strategy._plan.plan["ebc"].items()} if strategy._plan else None,
    }


def test_cli_yaml_selects_strategy_and_plan(tmp_path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(YAML)
    r0, r1 = run_distributed(
        _cli_job, 2, str(config), ["--trainer.default_root_dir", str(tmp_path)], init_process_group=False, timeout_s=240
    )
    assert r0["strategy"] == RecShardedStrategy.__name__ and r0["grad"] == "mean"
    assert r0["types"] == {
        "user": ShardingType.ROW_WISE,
        "item": ShardingType.TABLE_WISE,
        "geo": ShardingType.DATA_PARALLEL,
    }
    assert "ebc.embedding_bags.item.weight" not in r0["params"] and "ebc.embedding_bags.item.weight" in r1["params"]


def test_cli_strategy_by_registered_name(tmp_path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(YAML.split("  strategy:")[0] + "  strategy: rec_sharded\n")
    r0, _ = run_distributed(
        _cli_job, 2, str(config), ["--trainer.default_root_dir", str(tmp_path)], init_process_group=False, timeout_s=240
    )
    assert r0["strategy"] == RecShardedStrategy.__name__ and r0["grad"] == "sum"
