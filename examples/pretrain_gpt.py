"""Pretrain a tiny GPT on CPU from Megatron token files: a mixture schedule, packing, checkpoint and resume.

    torchrun --nproc_per_node=2 examples/pretrain_gpt.py --steps 40
    torchrun --nproc_per_node=2 examples/pretrain_gpt.py --steps 40 --checkpoint ck.pt --save-every 10
    torchrun --nproc_per_node=2 examples/pretrain_gpt.py --steps 40 --checkpoint ck.pt --resume

Rank 0 writes two small corpora as Megatron-LM indexed datasets (``X.bin`` +
``X.idx``, what Megatron, GPT-NeoX and OLMo train from) into ``--data``
unless they are there. The input pipeline, the same on every rank:

* ``shardkit.TokenDataset`` reads each corpus in place: whole documents,
  split over ranks and DataLoader workers, reshuffled every pass
  (``.repeat()``: a step-driven run never runs out);
* ``shardkit.interleave(..., weights=shardkit.Schedule(..., unit="tokens"))``
  mixes them 90/10 at first and anneals to 50/50 over the first 60,000
  tokens all ranks read together;
* ``.pack(SEQ_LEN, strategy="best_fit", position_ids=True, document_ids=True)``
  fills blocks with whole documents (as int64 tokens: ``dtype=torch.int64``),
  with ``position_ids`` restarting at each document and ``document_ids``, from
  which the model builds a causal block-diagonal mask (see docs/pretraining.md);
* ``shardkit.MixedLoader`` mixes every worker into every batch.

``loader.state_dict()`` (called on every rank) gathers every rank's position,
packer carry and schedule place into one plain-data state, which rank 0 saves
with the model; ``--resume`` loads it and training goes on with exactly the
batches an uninterrupted run would have had. ``--record DIR`` writes each
rank's per-step token checksums; ``--kill-at STEP`` ends the process with
SIGKILL after that step (a crash, for the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import shardkit

VOCAB, SEQ_LEN, BATCH_SIZE, DIM = 256, 128, 4, 64
MAX_DOCUMENT = 400  # position_ids count within a document, which may span blocks
CORPORA = {"web": (0, 600), "code": (1, 400)}  # name: (seed, documents)


def write_corpora(root: Path) -> None:
    """Two corpora of lognormal document lengths (median ~60 tokens), a token range each."""
    for name, (seed, documents) in CORPORA.items():
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(np.log(60), 0.8, documents).astype(int), 4, MAX_DOCUMENT)
        with shardkit.TokenWriter(str(root / f"{name}_text_document"), dtype=np.uint16) as writer:
            for length in lengths:
                low = 1 + seed * (VOCAB // 2)
                writer.write(rng.integers(low, low + VOCAB // 2 - 1, length, dtype=np.uint16))


def build_loader(root: Path, workers: int) -> shardkit.MixedLoader:
    sources = [shardkit.TokenDataset(str(root / f"{name}_text_document"), shuffle=True).repeat() for name in CORPORA]
    schedule = shardkit.Schedule([(0, [0.9, 0.1]), (60_000, [0.5, 0.5])], unit="tokens")
    mixed = shardkit.interleave(sources, weights=schedule, seed=0)
    # int64 tokens for the embedding (the files hold uint16), and the rows that keep documents apart
    blocks = mixed.pack(SEQ_LEN, strategy="best_fit", dtype=torch.int64, position_ids=True, document_ids=True)
    return shardkit.MixedLoader(blocks, batch_size=BATCH_SIZE, num_workers=workers, persistent_workers=True)


class TinyGPT(torch.nn.Module):
    """Two pre-norm transformer blocks; attention stays inside each packed document."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.position = torch.nn.Embedding(MAX_DOCUMENT, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(positions)
        mask = document_mask(documents)  # (batch, seq, seq): True where attention is not allowed
        for block in self.blocks:
            x = block(x, src_mask=mask.repeat_interleave(4, dim=0))
        return self.head(x)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Causal and block-diagonal: a token sees the earlier tokens of its own document only."""
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(documents.shape[1], documents.shape[1], dtype=torch.bool).tril()
    allowed = same & causal & (documents[:, :, None] >= 0)
    allowed |= torch.eye(documents.shape[1], dtype=torch.bool)  # padding attends to itself: no empty rows
    return ~allowed


def train_step(model, optimizer, batch) -> float:
    tokens, positions, documents = batch["input_ids"], batch["position_ids"], batch["document_ids"]
    logits = model(tokens[:, :-1], positions[:, :-1], documents[:, :-1])
    targets = tokens[:, 1:].masked_fill((documents[:, 1:] != documents[:, :-1]) | (documents[:, 1:] < 0), -100)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def prepare_data(root: Path, rank: int) -> None:
    if rank == 0 and not (root / "code_text_document.idx").exists():
        root.mkdir(parents=True, exist_ok=True)
        write_corpora(root)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "shardkit-pretrain-data")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--checkpoint", type=Path, help="file to save to every --save-every steps (and to resume from)")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="load --checkpoint and go on from its step")
    parser.add_argument("--record", type=Path, help="write each rank's per-step token checksums here")
    parser.add_argument("--kill-at", type=int, help="SIGKILL this process after this step (a crash)")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # plain `python examples/pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29537")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    prepare_data(args.data, rank)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = build_loader(args.data, args.workers)
    step = 0
    if args.resume:
        saved = torch.load(args.checkpoint, weights_only=True)  # plain tensors and data: nothing runs on load
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(json.loads(saved["loader"]))
        step = int(saved["step"])
    record: dict[int, int] = {}
    batches = iter(loader)
    while step < args.steps:
        batch = next(batches)
        loss = train_step(model, optimizer, batch)
        step += 1
        record[step] = int(batch["input_ids"].sum())
        if step % 10 == 0:
            shares = shardkit.mixture_shares(loader.state_dict())  # every rank calls it: it gathers
            if rank == 0 and shares is not None:
                realised, scheduled = (np.round(shares[k], 2).tolist() for k in ("realised", "scheduled"))
                print(f"step {step}: loss {loss:.3f}; token shares realised {realised}, scheduled {scheduled}")
        if args.checkpoint and step % args.save_every == 0:
            save(args.checkpoint, model, optimizer, loader, step, rank)
        if args.record:
            args.record.mkdir(parents=True, exist_ok=True)
            (args.record / f"rank{rank}.json").write_text(json.dumps(record))
        if args.kill_at == step:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print(f"trained {step} steps of {BATCH_SIZE} x {SEQ_LEN} packed tokens per rank")
    dist.destroy_process_group()


def save(path: Path, model, optimizer, loader, step: int, rank: int) -> None:
    """Every rank gives its loader position (a collective); rank 0 writes, atomically."""
    loader_state = json.dumps(loader.state_dict())
    if rank == 0:
        state = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader_state,
            "step": step,
        }
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)
    dist.barrier()


if __name__ == "__main__":
    main()
