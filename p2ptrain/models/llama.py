"""A Llama that splits into pipeline stages: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Stage 0 owns the token embeddings, the last stage the final norm, the LM head and the loss. Every stage is
built from the same seed, so peers that build the same layers get the same parameters. The computation is
`transformers`' LlamaForCausalLM's (rotary embeddings rotate the two halves of a head), so its checkpoints load
unchanged (`p2ptrain.models.hf`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ptrain.models.base import StageModel
from p2ptrain.models.configs import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32, as Hugging Face's LlamaRMSNorm: in fp16 the backward of rsqrt overflows on small activations
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of the head's dimension pairs, stretched as the config's rope scaling says."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths beyond the low-frequency bound are stretched by the factor, those under the
    # high-frequency bound kept, those between blended
    context = scaling.original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = (wavelen >= context / scaling.high_freq_factor) & (wavelen <= context / scaling.low_freq_factor)
    return torch.where(medium, blended, stretched)


def rotary_tables(config: LlamaConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(seq_len).float(), rotary_frequencies(config))
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        q_dim, kv_dim, bias = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
            config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        cfg = self.config
        q = self.q_proj(x).view(batch, seq, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, cfg.num_heads * cfg.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaStage(StageModel):
    """Layers [start, end) of a Llama; the embeddings if start == 0, the head and loss if end == num_layers. With
    tied embeddings the head is the embedding matrix: one tensor when one stage holds both, otherwise a copy in the
    last stage that starts equal to the first stage's (`shared_parameters`)."""

    def __init__(self, config: LlamaConfig, *, start: int, end: int, seed: int = 0):
        super().__init__(config, start=start, end=end)
        # Each part draws from its own seeded stream, so the same layer gets the same weights in any split.
        if self.is_first:
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            _init(self.embed, config, seed=seed, stream=0)
        self.layers = nn.ModuleList()
        for index in range(start, end):
            block = Block(config)
            _init(block, config, seed=seed, stream=1 + index)
            self.layers.append(block)
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_embeddings and self.is_first:
                self.lm_head.weight = self.embed.weight
            elif config.tie_embeddings:
                _init(self.lm_head, config, seed=seed, stream=0)  # the embeddings' stream: the same matrix
            else:
                _init(self.lm_head, config, seed=seed, stream=1 + config.num_layers)
        cos, sin = rotary_tables(config, config.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(inputs) if self.is_first else inputs
        seq = x.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for block in self.layers:
            x = self.apply_block(block, x, cos, sin)
        if not self.is_last:
            return x
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    def shared_parameters(self) -> dict[str, str]:
        """With tied embeddings in two stages, the copies of the embedding matrix (one tensor in one stage)."""
        if self.config.tie_embeddings and self.is_first != self.is_last:
            return {"embed.weight" if self.is_first else "lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def hf_names(self) -> dict[str, str]:
        names = {}
        for name, _ in self.named_parameters():
            part, _, rest = name.partition(".")
            if part == "embed":
                names[name] = "model.embed_tokens.weight"
            elif part == "layers":
                index, _, rest = rest.partition(".")
                names[name] = f"model.layers.{self.start + int(index)}.{_HF_BLOCK.get(rest, rest)}"
            elif part == "norm":
                names[name] = "model.norm.weight"
            else:  # the head: the embedding matrix itself when tied
                names[name] = "model.embed_tokens.weight" if self.config.tie_embeddings else "lm_head.weight"
        return names


# a block's parameter names that differ from transformers' (the rest, e.g. mlp.up_proj.weight, are the same)
_HF_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
             **{f"attn.{p}_proj.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")}}


def _init(module: nn.Module, config: LlamaConfig, *, seed: int, stream: int) -> None:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stream)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight") or name.endswith("bias"):
            with torch.no_grad():
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            continue
        std = config.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * config.num_layers)  # GPT-2's scaled residual init
        with torch.no_grad():
            param.normal_(0.0, std, generator=generator)
