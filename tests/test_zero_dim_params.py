"""0-dim parameters (CLIP's logit_scale): sharded models train them on both backends."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_bridge
from fsdp_bridge import Backend, BridgeConfig


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return (x * self.scale).square().mean()


def _tiny_clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        ),
        projection_dim=8,
    )
    config._attn_implementation = "eager"
    return CLIPModel(config)


def _zero_dim(out_dir: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for backend in Backend:
        torch.manual_seed(0)
        reference = Scaled()
        sharded = fsdp_bridge.shard(copy.deepcopy(reference), BridgeConfig(backend=backend, wrap=["Linear"]))
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sharded, reference))
        losses, ref_losses = [], []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
            loss = sharded(x)
            loss.backward()
            fsdp_bridge.clip_grad_norm_(sharded, 1.0)
            opt.step()
            opt.zero_grad()
            ref_loss = reference(x)
            ref_loss.backward()
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        out[backend.value] = (losses, ref_losses, float(sharded.scale), float(reference.scale))
        clip = fsdp_bridge.shard(_tiny_clip(), BridgeConfig(backend=backend))
        ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
        pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
        clip_opt = torch.optim.AdamW(clip.parameters(), lr=1e-2)
        clip(input_ids=ids, pixel_values=pixels, return_loss=True).loss.backward()
        clip_opt.step()
        fsdp_bridge.save_checkpoint(Path(out_dir) / f"clip-{backend.value}", clip, kind="full")
        out[f"clip-{backend.value}"] = float(clip.logit_scale)
    return out


def test_zero_dim_parameters_train_on_both_backends_and_export(tmp_path: Path, run_on_ranks) -> None:
    from transformers import CLIPModel

    results = run_on_ranks(_zero_dim, 2, str(tmp_path))
    for r in results:
        for backend in ("fsdp1", "fsdp2"):
            losses, ref_losses, scale, ref_scale = r[backend]
            torch.testing.assert_close(losses, ref_losses, rtol=1.3e-6, atol=1e-5)
            torch.testing.assert_close(scale, ref_scale, rtol=1.3e-6, atol=1e-6)
            assert scale != 2.0  # it trained
    assert results[0] == results[1] or all(results[0][k] == results[1][k] for k in results[0] if "clip" in k)
    for backend in ("fsdp1", "fsdp2"):
        loaded = CLIPModel.from_pretrained(tmp_path / f"clip-{backend}")
        assert loaded.logit_scale.shape == torch.Size([])  # the shape the model defines
        assert float(loaded.logit_scale) == results[0][f"clip-{backend}"]
