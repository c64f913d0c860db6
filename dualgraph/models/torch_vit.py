"""A small pre-LN vision transformer in PyTorch: the reference model of tests and examples.

:class:`ViTBlock` returns ``(hidden, None)`` like Megatron's vision layers, and
:class:`VisionEncoder` returns ``{"hidden", "pooled", "aux_loss": None}``: outputs with ``None``
leaves, which ``torch.cuda.make_graphed_callables`` cannot capture and dualgraph can. A block
holds no state but its parameters, so a graphed block slots in where the block was:

    encoder.blocks[0] = make_graphed_callables(encoder.blocks[0], (sample_hidden,))

:mod:`dualgraph.models.jax_vit` is the same math in JAX.

>>> import torch
>>> encoder = VisionEncoder(image_size=16, patch_size=8, dim=32, depth=1, heads=2)
>>> out = encoder(torch.randn(2, 3, 16, 16))
>>> out["hidden"].shape, out["pooled"].shape, out["aux_loss"]
(torch.Size([2, 4, 32]), torch.Size([2, 32]), None)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ViTBlock", "VisionEncoder"]


class ViTBlock(nn.Module):
    """Pre-LN block: ``x + proj(attention(ln1(x)))``, then ``x + fc2(gelu(fc1(ln2(x))))``.

    Attention is the explicit ``softmax(q k^T / sqrt(head_dim)) v`` (exact erf GELU in the MLP),
    so that its float32 result is the same math as the JAX version's; ``dropout`` applies after
    the attention projection and after ``fc2``. ``forward(x)`` returns ``(x, None)``.

    ``forward(x, valid_length=n)`` treats the tokens from position ``n`` on as padding: no token
    attends to them, so the first ``n`` tokens come out as from ``x[:, :n]`` alone (up to
    rounding); ``n`` is an int or a 0-d tensor, as ``fallback="pad"`` of
    :func:`dualgraph.torch.make_graphed_callables` passes it. (PyTorch only: the JAX block has
    no padding.)

    >>> block = ViTBlock(dim=8, heads=2)
    >>> hidden, extra = block(torch.randn(2, 5, 8))
    >>> hidden.shape, extra
    (torch.Size([2, 5, 8]), None)
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, int(dim * mlp_ratio))
        self.fc2 = nn.Linear(int(dim * mlp_ratio), dim)
        self.dropout = dropout

    def attention(
        self, x: torch.Tensor, valid_length: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Multi-head self-attention of ``x`` (batch, tokens, dim), before the projection.

        Keys from position ``valid_length`` on (padding) get no attention.
        """
        batch, tokens, dim = x.shape
        head_dim = dim // self.heads
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        if valid_length is not None:
            padding = torch.arange(tokens, device=x.device) >= valid_length
            scores = scores.masked_fill(padding, float("-inf"))
        mixed = scores.softmax(dim=-1) @ v
        return mixed.transpose(1, 2).reshape(batch, tokens, dim)

    def forward(
        self, x: torch.Tensor, valid_length: int | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        x = x + self._drop(self.proj(self.attention(self.ln1(x), valid_length)))
        x = x + self._drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return x, None

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0:
            return F.dropout(x, self.dropout, self.training)
        return x


class VisionEncoder(nn.Module):
    """Patch embedding (a strided ``Conv2d``), learned positions, ``depth`` blocks, final LN.

    ``forward(images)`` takes ``(batch, channels, image_size, image_size)`` and returns
    ``{"hidden": (batch, tokens, dim), "pooled": hidden.mean(dim=1), "aux_loss": None}``.
    The blocks are ``self.blocks`` (an ``nn.ModuleList``), called as ``hidden, _ = block(hidden)``.

    Images of another size (height and width multiples of ``patch_size``) get the learned
    positions linearly interpolated to their grid of patches (:meth:`positions`), so one encoder
    trains on several resolutions. (PyTorch only: the JAX encoder takes ``image_size``.)

    >>> encoder = VisionEncoder()
    >>> sorted(encoder(torch.randn(1, 3, 32, 32)))
    ['aux_loss', 'hidden', 'pooled']
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 8,
        channels: int = 3,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size")
        self.grid = image_size // patch_size
        self.patch_size = patch_size
        tokens = self.grid**2
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.ModuleList(
            ViTBlock(dim, heads, mlp_ratio=mlp_ratio, dropout=dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def positions(self, rows: int, columns: int) -> torch.Tensor:
        """The position embeddings of a grid of ``rows x columns`` patches: (1, tokens, dim).

        The learned ones for the ``image_size`` grid; for another grid, those linearly
        interpolated (``align_corners=False``, as ``F.interpolate(mode="bilinear")``), written
        as two small matrix products so that they run in a CUDA graph and are deterministic.

        >>> encoder = VisionEncoder(image_size=16, patch_size=8, dim=4, depth=1, heads=1)
        >>> encoder.positions(3, 2).shape
        torch.Size([1, 6, 4])
        """
        if rows == columns == self.grid:
            return self.pos_embed
        learned = self.pos_embed.reshape(self.grid, self.grid, -1)
        down = _linear_interpolation(rows, self.grid, learned)
        across = _linear_interpolation(columns, self.grid, learned)
        grid = torch.einsum("ia,abd->ibd", down, learned)
        grid = torch.einsum("jb,ibd->ijd", across, grid)
        return grid.reshape(1, rows * columns, -1)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor | None]:
        height, width = images.shape[-2:]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"images of {height}x{width} pixels: each side must be a multiple of "
                f"patch_size ({self.patch_size})"
            )
        patches = self.patch_embed(images)
        positions = self.positions(patches.shape[-2], patches.shape[-1])
        hidden = patches.flatten(2).transpose(1, 2) + positions
        for block in self.blocks:
            hidden, _ = block(hidden)
        hidden = self.norm(hidden)
        return {"hidden": hidden, "pooled": hidden.mean(dim=1), "aux_loss": None}


def _linear_interpolation(size: int, source: int, like: torch.Tensor) -> torch.Tensor:
    """The ``(size, source)`` matrix of 1-D linear interpolation with ``align_corners=False``."""
    device = like.device
    scale = source / size
    position = ((torch.arange(size, device=device) + 0.5) * scale - 0.5).clamp(min=0)
    low = position.floor().clamp(max=source - 1)
    high = (low + 1).clamp(max=source - 1)
    weight = (position - low)[:, None]
    columns = torch.arange(source, device=device)
    matrix = (columns == low[:, None]) * (1 - weight) + (columns == high[:, None]) * weight
    return matrix.to(like.dtype)
