"""ALBERT split into pipeline stages: factorized embeddings, shared post-norm blocks, the masked-LM head.

Stage 0 owns the embeddings (words, positions, token types) and their mapping up to the hidden size, the last stage
the MLM head. Every stage that applies a layer group holds a copy of that group's block, and every copy starts
equal because each is drawn from the group's own seeded stream; `shared_parameters` names the copies so that their
gradients are combined across stages. The computation is `transformers`' AlbertForMaskedLM's, so its checkpoints
load unchanged (`p2ptrain.models.hf`).
"""
from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ptrain.models.base import StageModel
from p2ptrain.models.configs import AlbertConfig

M = TypeVar("M", bound=nn.Module)

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class Embeddings(nn.Module):
    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.embedding_size)
        self.position = nn.Embedding(config.max_seq_len, config.embedding_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.norm = nn.LayerNorm(config.embedding_size, eps=config.norm_eps)
        self.mapping_in = nn.Linear(config.embedding_size, config.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        # one segment: every token has type 0, as transformers assumes without token_type_ids
        x = self.word(ids) + self.token_type.weight[0] + self.position(positions)
        return self.mapping_in(self.norm(x))


class Block(nn.Module):
    """ALBERT's layer: attention and the feed-forward net, each followed by a residual LayerNorm (post-norm)."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.query, self.key, self.value, self.dense = (nn.Linear(h, h) for _ in range(4))
        self.attention_norm = nn.LayerNorm(h, eps=config.norm_eps)
        self.ffn = nn.Linear(h, config.intermediate_size)
        self.ffn_output = nn.Linear(config.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        heads = self.config.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, heads, hidden // heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        x = self.attention_norm(x + self.dense(attended.transpose(1, 2).reshape(batch, seq, hidden)))
        return self.output_norm(x + self.ffn_output(ACTIVATIONS[self.config.hidden_act](self.ffn(x))))


class MLMHead(nn.Module):
    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.norm = nn.LayerNorm(config.embedding_size, eps=config.norm_eps)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(ACTIVATIONS[self.config.hidden_act](self.dense(x))))


class AlbertStage(StageModel):
    """Layers [start, end) of an ALBERT; the embeddings if start == 0, the MLM head and loss if end == num_layers.
    Labels of -100 (unmasked tokens) count for nothing in the loss, which is scaled to every token (`forward`).
    With tied embeddings the decoder is the word embedding matrix: one tensor when one stage holds both, otherwise a
    copy."""

    def __init__(self, config: AlbertConfig, *, start: int, end: int, seed: int = 0):
        super().__init__(config, start=start, end=end)
        if self.is_first:
            self.embeddings = Embeddings(config)
            _init(self.embeddings, config, seed=seed, stream=0)
        self.groups = nn.ModuleDict()
        for group in sorted({config.group_of(layer) for layer in range(start, end)}):
            block = Block(config)
            _init(block, config, seed=seed, stream=1 + group)
            self.groups[str(group)] = block
        if self.is_last:
            self.head = MLMHead(config)
            _init(self.head, config, seed=seed, stream=1 + config.num_groups)
            if config.tie_embeddings and self.is_first:
                self.head.decoder.weight = self.embeddings.word.weight
            elif config.tie_embeddings:
                with torch.no_grad():  # the embeddings' stream draws the word matrix first: the same matrix
                    self.head.decoder.weight.copy_(_init(Embeddings(config), config, seed=seed, stream=0).word.weight)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(inputs) if self.is_first else inputs
        for layer in range(self.start, self.end):
            x = self.apply_block(self.groups[str(self.config.group_of(layer))], x)
        if not self.is_last:
            return x
        logits = self.head(x)
        if labels is None:
            return logits
        # summed over the masked tokens and scaled to every token of the rows: divided by the batch's tokens, as the
        # swarm averages, it is the mean loss of a masked token (every row has as many, `data.Masking`)
        masked = (labels != -100).sum().clamp(min=1)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss * labels.numel() / masked

    def shared_parameters(self) -> dict[str, str]:
        """The blocks (other stages may apply the same groups) and, when tied, the word matrix; keyed by their
        checkpoint names. A stage that holds the whole model shares nothing."""
        if self.is_first and self.is_last:
            return {}
        tied = {"embeddings.word.weight", "head.decoder.weight"} if self.config.tie_embeddings else set()
        return {name: key for name, key in self.hf_names().items() if name.startswith("groups.") or name in tied}

    def hf_names(self) -> dict[str, str]:
        names = {}
        for name, _ in self.named_parameters():
            part, _, rest = name.partition(".")
            if part == "embeddings":
                names[name] = _HF_EMBEDDINGS[rest]
            elif part == "groups":
                group, _, rest = rest.partition(".")
                names[name] = f"albert.encoder.albert_layer_groups.{group}.albert_layers.0.{_HF_BLOCK.get(rest, rest)}"
            elif rest.startswith("decoder.") and not self.config.tie_embeddings:
                names[name] = f"predictions.{rest}"
            elif rest == "decoder.weight":
                names[name] = "albert.embeddings.word_embeddings.weight"
            else:
                names[name] = _HF_HEAD[rest]
        return names


_HF_EMBEDDINGS = {"word.weight": "albert.embeddings.word_embeddings.weight",
                  "position.weight": "albert.embeddings.position_embeddings.weight",
                  "token_type.weight": "albert.embeddings.token_type_embeddings.weight",
                  "norm.weight": "albert.embeddings.LayerNorm.weight", "norm.bias": "albert.embeddings.LayerNorm.bias",
                  "mapping_in.weight": "albert.encoder.embedding_hidden_mapping_in.weight",
                  "mapping_in.bias": "albert.encoder.embedding_hidden_mapping_in.bias"}
_HF_BLOCK = {**{f"{p}.{kind}": f"attention.{p}.{kind}" for p in ("query", "key", "value", "dense")
                for kind in ("weight", "bias")},
             "attention_norm.weight": "attention.LayerNorm.weight", "attention_norm.bias": "attention.LayerNorm.bias",
             "output_norm.weight": "full_layer_layer_norm.weight", "output_norm.bias": "full_layer_layer_norm.bias"}
_HF_HEAD = {"dense.weight": "predictions.dense.weight", "dense.bias": "predictions.dense.bias",
            "norm.weight": "predictions.LayerNorm.weight", "norm.bias": "predictions.LayerNorm.bias",
            "decoder.bias": "predictions.bias"}  # tied: transformers ties the decoder's bias to this one


def _init(module: M, config: AlbertConfig, *, seed: int, stream: int) -> M:
    """BERT's initialization from one seeded stream per part: normal weights, zero biases, unit LayerNorm gains."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stream)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.init_std, generator=generator)
    return module
