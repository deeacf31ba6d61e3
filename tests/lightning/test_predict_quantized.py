"""``trainer.predict`` with a model whose collections were quantized: one process, the default strategy."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_rec import quantize_embeddings
from lightning_rec.data import ClickDataModule
from lightning_rec.models import DLRM
from lightning_rec.quant import EmbeddingBagCollection as QuantEBC


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_trainer_predict_scores_with_the_quantized_tables(dtype: str) -> None:
    data = ClickDataModule(batch_size=64, train_rows=64, val_rows=0, test_rows=150, size=1e-4)
    torch.manual_seed(0)
    float_model = DLRM(
        num_dense=data.num_dense,
        feature_names=data.feature_names,
        num_embeddings_per_feature=data.cardinalities,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    ).eval()
    model = quantize_embeddings(float_model, dtype, inplace=False)
    assert isinstance(model.sparse_arch.embedding_bag_collection, QuantEBC)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    scores = trainer.predict(model, datamodule=data)
    assert scores is not None and [len(s) for s in scores] == [64, 64, 22]  # type: ignore[arg-type]
    data.setup("predict")
    with torch.no_grad():
        for got, batch in zip(scores, data.predict_dataloader()):
            torch.testing.assert_close(got, torch.sigmoid(model(batch.dense, batch.sparse)))
            assert not torch.equal(got, torch.sigmoid(float_model(batch.dense, batch.sparse)))
