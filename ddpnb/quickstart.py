"""`python -m ddpnb.quickstart`: train a small classifier with DDP on whatever this machine has.

One rank per GPU over NCCL when there are GPUs, else two CPU ranks over gloo. Synthetic data, no download.
"""

from __future__ import annotations

import os

import ddpnb


def train(rank: int, world_size: int, epochs: int = 5) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    device = torch.device(ddpnb.device())
    generator = torch.Generator().manual_seed(0)  # every rank builds the same data set
    x = torch.randn(4096, 20, generator=generator)
    y = (x[:, :10].sum(dim=1) > 0).long()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank)
    loader = DataLoader(data, batch_size=128, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step, (inputs, labels) in enumerate(loader):
            inputs, labels = inputs.to(device), labels.to(device)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ddpnb.log(step=epoch * len(loader) + step, loss=loss.item())
        print(f"epoch {epoch}: loss {loss.item():.3f} on {device}")
    with torch.no_grad():
        correct = (model(x.to(device)).argmax(dim=1) == y.to(device)).float().mean()
    dist.all_reduce(correct)
    return {"accuracy": correct.item() / world_size, "world_size": world_size}


def main() -> None:
    import torch

    gpus = torch.cuda.device_count()
    print(f"ddpnb quickstart: {gpus} GPU(s) here -> {f'{gpus} NCCL ranks' if gpus else '2 CPU ranks over gloo'}")
    result = ddpnb.run(train, gpus="all" if gpus else None, nprocs=None if gpus else 2)
    # no time of its own: the run's line above says how long it took, and one run has one duration
    print(f"rank 0 returned {result} (logs: {ddpnb.last_run().run_dir})")
    if result["accuracy"] < 0.9:
        raise SystemExit(f"quickstart trained poorly (accuracy {result['accuracy']:.2f}); see the logs above")


if __name__ == "__main__":
    os.environ.setdefault("DDPNB_VIEW", "text")
    main()
