"""A ResNet of configurable size (He et al. 2016), for the synthetic and CIFAR-10 examples,
and a small decoder-only transformer (:class:`TinyLM`) for the language-model example.

torchvision does not import beside this machine's PyTorch, so the model is
written out: a stem, ``stages`` stages of ``blocks`` basic residual blocks each
(width doubling, resolution halving from the second stage), global pooling and
a linear classifier.  ``resnet(width=64, blocks=(2, 2, 2, 2))`` is ResNet-18's
layout; the defaults of the examples are far smaller, for 2-core machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BasicBlock(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                             torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet(torch.nn.Module):
    def __init__(self, width=16, blocks=(1, 1, 1), num_classes=10, in_channels=3):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                                        torch.nn.BatchNorm2d(width), torch.nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet(width=16, blocks=(1, 1, 1), num_classes=10) -> ResNet:
    return ResNet(width, tuple(blocks), num_classes)


class CausalSelfAttention(torch.nn.Module):
    """Multi-head self-attention where position t sees positions <= t only (the causal mask
    of a decoder: ``scaled_dot_product_attention(is_causal=True)``)."""

    def __init__(self, d_model, heads):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    """A pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x)) (GPT-2's)."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(torch.nn.Module):
    """A decoder-only transformer language model (GPT-2's layout, small): token and learned
    position embeddings, ``layers`` pre-norm blocks, a final LayerNorm and a linear head
    over the ``vocab`` next-token logits.  Inputs (batch, t <= context) of token ids."""

    def __init__(self, vocab=256, context=64, d_model=128, layers=4, heads=4):
        super().__init__()
        self.context = context
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.Sequential(*[Block(d_model, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens exceed the context of {self.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.blocks(x)))
