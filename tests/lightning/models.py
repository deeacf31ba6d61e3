"""A small click model and data, shared by the Lightning tests."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, RecModule

TABLES = [
    EmbeddingBagConfig(name="user", num_embeddings=11, embedding_dim=4, feature_names=["user_id"]),
    EmbeddingBagConfig(
        name="item", num_embeddings=13, embedding_dim=4, feature_names=["item_id", "history"], pooling="mean"
    ),
    EmbeddingBagConfig(name="geo", num_embeddings=5, embedding_dim=4, feature_names=["geo"]),
]
KEYS = [f for t in TABLES for f in t.feature_names]
# Trainer arguments of a test fit: no logger, checkpoints, progress bar, model summary or sanity check
QUIET_TRAINER = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


class Clicks(Dataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        feats = {}
        for t in TABLES:
            for f in t.feature_names:
                k = int(torch.randint(0, 4 if f == "history" else 2, (1,), generator=g))
                feats[f] = torch.randint(0, t.num_embeddings, (k,), generator=g)
        return feats, torch.rand((), generator=g).round()


def collate(samples):
    lengths = torch.tensor([len(s[0][k]) for k in KEYS for s in samples])
    values = torch.cat([s[0][k] for k in KEYS for s in samples])
    return KeyedJaggedTensor(KEYS, values, lengths=lengths), torch.stack([s[1] for s in samples])


class ClickModule(RecModule):
    def __init__(self, batch_size: int = 4, lr: float = 0.2, plan=None) -> None:
        super().__init__()
        self.batch_size, self.lr, self._plan = batch_size, lr, plan
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(TABLES)
        self.head = torch.nn.Linear(4 * len(KEYS), 1)

    def configure_sharding(self):
        return self._plan

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).squeeze(1)

    def training_step(self, batch, _):
        kjt, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self(kjt), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        kjt, y = batch
        self.log("val_loss", torch.nn.functional.binary_cross_entropy_with_logits(self(kjt), y), sync_dist=True)

    def test_step(self, batch, _):
        kjt, y = batch
        self.log("test_loss", torch.nn.functional.binary_cross_entropy_with_logits(self(kjt), y), sync_dist=True)

    def predict_step(self, batch, _):
        return torch.sigmoid(self(batch[0]))

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        # an explicit unshuffled sampler, so the one-process reference can see the same global batches
        ds = Clicks()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        return DataLoader(ds, batch_size=self.batch_size, collate_fn=collate, sampler=sampler)

    def val_dataloader(self):
        return DataLoader(Clicks(16), batch_size=self.batch_size, collate_fn=collate, shuffle=False)
