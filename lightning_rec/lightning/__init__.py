"""The Lightning front end: ``Trainer(strategy="rec_sharded")`` (``strategy``), ``Fabric(strategy="rec_sharded")``
(``fabric``), the core both call (``shard_setup``; the sharding itself is ``lightning_rec.front_end``, which
``DistributedModelParallel`` calls too), evaluation with unequal batch counts (``uneven``), SIGTERM agreed across
ranks (``preemption``), ranks started by Lightning's launcher reported when they fail after rank 0
(``child_exits``), ``RecModule`` (``rec_module``) and the callbacks (``callbacks``).

Import the public names from ``lightning_rec``; the modules' old paths (``lightning_rec.strategy``, ...) are
aliases of these (``lightning_rec/__init__.py``). Nothing is imported here: ``quant`` reads checkpoints through
``rec_module`` without loading the strategies.
"""
