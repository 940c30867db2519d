"""The built-in GPT: a decoder-only transformer as GPT-2 and nanoGPT build it.

Pre-norm blocks (LayerNorm → causal self-attention → residual, LayerNorm → MLP → residual), attention
through `scaled_dot_product_attention` (flash or memory-efficient kernels on GPUs), token embedding tied
to the output layer, GPT-2's initialisation (N(0, 0.02), residual projections scaled by 1/√(2·layers)).
`forward(input_ids)` returns logits (batch, positions, vocabulary); dtrain's default loss is
cross-entropy over every position (-100 targets left out). `forward(input_ids, position_ids)` takes packed
windows (data/packing.py): positions restart at 0 where a document begins, and each position attends to
its own document only (a block-diagonal causal mask for scaled_dot_product_attention: correct on every
device, and on GPUs it runs the memory-efficient kernel rather than flash, which takes no mask).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, positions, positions) bool, True where a position may attend: an earlier or the same
    position of its own document, documents read from position ids that restart at 0 where one begins
    (as Hugging Face's padding-free collator marks them). Every row holds its diagonal: never all False."""
    docs = position_ids.eq(0).cumsum(dim=-1)  # 0, 0, 1, 1, 1, 2 ...: which document each position is in
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (docs.unsqueeze(-1) == docs.unsqueeze(-2)).logical_and(causal).unsqueeze(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.c_attn(x)
        c = qkv.shape[-1] // 3  # n_embd; under tensor parallel the width of this rank's heads (tp_plan.py)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in qkv.split(c, dim=2))
        p = self.dropout if self.training else 0.0
        # With a mask (packed documents) it holds the causal part too.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=p)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    _no_split_modules: ClassVar[list[str]] = [
        "Block"
    ]  # the unit of sharding (FSDP) and of activation checkpointing, as in HF
    # Under its tensor-parallel plan (tp_plan.py) every dropout acts on a shard: the embedding's and the
    # residuals' on sequence shards, attention's on the rank's own heads (parallel/dropout.py).
    tp_dropout_on_shards: ClassVar[bool] = True

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.0,
        bias: bool = False,
    ):
        super().__init__()
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.dropout, self.bias = dropout, bias  # said in model.json: a pipeline stage may lack ln_f
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds tokens and scores them
        # Set by context parallel (parallel/context.py) for a step: the positions of this rank's part of
        # each sequence, which are not 0..t-1 (torch balances the causal work by reordering chunks).
        self.sequence_positions: torch.Tensor | None = None
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: residual projections scaled for depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's block_size {self.block_size}")
        mask = None if position_ids is None else document_causal_mask(position_ids)
        # A pipeline stage (parallel/stages.py) holds some blocks and sets the parts it lacks to None:
        # a stage after the first is handed the previous one's activations, and passes them through.
        x = input_ids
        if self.wte is not None:
            pos = torch.arange(t, device=input_ids.device) if position_ids is None else position_ids
            pos = pos if self.sequence_positions is None else self.sequence_positions
            x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.h:
            x = block(x) if mask is None else block(x, mask)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x if self.lm_head is None else self.lm_head(x)

    def tp_plan(self, loss_parallel: bool = False) -> dict[str, Any]:
        """How tensor parallel splits this model (tp_plan.py): module patterns → parallel styles; with
        `loss_parallel`, its logits left split over the vocabulary for the loss."""
        from dtrain.models.gpt import tp_plan

        return tp_plan.plan(loss_parallel)

    def tp_problem(self, tp: int, window: int | None = None, sizes: Collection[int] | None = None) -> str | None:
        """Why `tp` processes cannot split this model (on windows of `window` tokens), in one line naming
        the sizes that would (of `sizes`, where given), or None."""
        from dtrain.models.gpt import tp_plan

        return tp_plan.problem(self.n_head, self.n_embd, tp, window, sizes)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (the tied matrix once); without the position embedding, as GPT-2 counts."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, as nanoGPT and PaLM (appendix B) count: 6N for the weights' matmuls
        forward and backward, plus 12·layers·width·positions for attention."""
        t = seq_len or self.block_size
        return 6 * self.num_params() + 12 * self.n_layer * self.n_embd * t

    def _positions_split_over(self) -> int:
        """Over how many tensor-parallel ranks sequence parallel splits the positions (1 unsplit; FSDP
        alone shards the weight over its own mesh and leaves the positions whole)."""
        mesh = getattr(self.wpe.weight, "device_mesh", None) if self.wpe is not None else None
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        return mesh["tp"].size() if mesh is not None and "tp" in names else 1

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 50,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue `idx` (batch, positions) by sampling `max_new_tokens` tokens; at temperature 0 the
        likeliest token each time (greedy: the same continuation whatever the generator)."""
        multiple = self._positions_split_over()
        for _ in range(max_new_tokens):
            window = idx[:, -self.block_size :]
            # Under sequence parallel the positions split evenly over the tp ranks: padded at the end,
            # which a causal model's last real position never sees.
            t = window.shape[1]
            logits = self(F.pad(window, (0, -t % multiple)))
            # Split over the vocabulary under tensor parallel (tp_plan.py): a DTensor, gathered whole.
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            logits = logits[:, t - 1, :]
            if temperature == 0:
                idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
                continue
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
        return idx
