"""How a sharded collection routes and checks the ids of the tables a ``stages.RawIdHook`` feeds raw ids.

Managed collision's hook names the tables fed raw ids and, for each raw id, a row of its bucket. The collection
owns one :class:`RawIdRouting` for the hook it has now (or none); every input dist started afterwards routes
with it, while those already started keep the one they were routed for.
"""

from __future__ import annotations

import copy
from functools import partial

from lightning_rec.embedding_modules import FeatureLayout
from lightning_rec.pipeline.input_dist import RowKey
from lightning_rec.pipeline.stages import RawIdHook

__all__ = ["RawIdRouting"]

_MAX_ID = (1 << 63) - 1  # raw ids are only checked to be non-negative


class RawIdRouting:
    """``hook`` (None: every table takes row ids) and what the input dist needs of it: ``row_keys``, the row
    key of each raw-id feature (by feature index), and ``layout``, the collection's layout with those features'
    row counts lifted so that the input check only rejects negative raw ids.
    """

    def __init__(self, hook: RawIdHook | None, layout: FeatureLayout) -> None:
        self.hook = hook
        self.row_keys: dict[int, RowKey] | None = None
        self.layout: FeatureLayout | None = None
        if hook is None:
            return
        names = layout.feature_table_names
        unknown = sorted(hook.tables - set(names))
        if unknown:
            raise ValueError(f"raw-id tables {unknown} are not tables of this collection ({sorted(set(names))})")
        self.row_keys = {f: partial(hook.row_key, t) for f, t in enumerate(names) if t in hook.tables}
        self.layout = copy.copy(layout)
        self.layout.rows = [_MAX_ID if t in hook.tables else r for t, r in zip(names, layout.rows)]
