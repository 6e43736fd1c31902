"""Built-in PyTorch architectures: digits CNN, ResNet-18/34/50/101/152, a BERT-style encoder."""

from __future__ import annotations

import math

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Three conv blocks and a two-layer classifier for 1-channel digit images."""

    def __init__(self, image_size: int = 32, channels: tuple[int, ...] = (32, 64, 128), num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 1
        size = image_size
        for i, c in enumerate(channels):
            layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            if i < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            c_in = c
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c_in, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, c: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, c: int, stride: int = 1):
        super().__init__()
        out_c = c * self.expansion
        self.conv1 = nn.Conv2d(c_in, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv3 = nn.Conv2d(c, out_c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_c)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != out_c:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, out_c, 1, stride, bias=False), nn.BatchNorm2d(out_c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


_RESNET_LAYERS = {18: (BasicBlock, [2, 2, 2, 2]), 34: (BasicBlock, [3, 4, 6, 3]),
                  50: (Bottleneck, [3, 4, 6, 3]), 101: (Bottleneck, [3, 4, 23, 3]), 152: (Bottleneck, [3, 8, 36, 3])}


class ResNet(nn.Module):
    """The standard ImageNet ResNet topology (He et al.), as in torchvision."""

    def __init__(self, depth: int = 18, num_classes: int = 1000, in_channels: int = 3):
        super().__init__()
        if depth not in _RESNET_LAYERS:
            raise ValueError(f"ResNet depth {depth} not in {sorted(_RESNET_LAYERS)}")
        block, counts = _RESNET_LAYERS[depth]
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = 64
        stages = []
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), counts, strict=True)):
            blocks = []
            for j in range(n):
                stride = 2 if (j == 0 and i > 0) else 1
                blocks.append(block(c_in, width, stride))
                c_in = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class EncoderLayer(nn.Module):
    """Post-LayerNorm BERT encoder layer with explicit attention math (MatMul / Softmax in ONNX)."""

    def __init__(self, hidden: int, heads: int, intermediate: int):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ff1 = nn.Linear(hidden, intermediate)
        self.ff2 = nn.Linear(intermediate, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)
        self.act = nn.GELU()

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.attn_out(ctx))
        return self.ln2(x + self.ff2(self.act(self.ff1(x))))


class BertTiny(nn.Module):
    def __init__(self, vocab_size: int = 30522, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2,
                 intermediate_size: int = 512, seq_len: int = 128, num_labels: int = 2):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.word = nn.Embedding(vocab_size, hidden_size)
        self.position = nn.Embedding(seq_len, hidden_size)
        self.ln = nn.LayerNorm(hidden_size, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(hidden_size, num_heads, intermediate_size) for _ in range(num_layers))
        self.pooler = nn.Linear(hidden_size, hidden_size)
        self.classifier = nn.Linear(hidden_size, num_labels)
        self.register_buffer("positions", torch.arange(seq_len).unsqueeze(0), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.word(input_ids) + self.position(self.positions))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, example: torch.Tensor, batches: int = 4, seed: int = 0) -> None:
    """Set BatchNorm running statistics from random inputs so a randomly initialised network has
    realistic, normalised activations (instead of growing ones) when exported in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    g = torch.Generator().manual_seed(seed)
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the batches below
    model.train()
    shape = (max(4, example.shape[0]), *example.shape[1:])
    for _ in range(batches):
        model(torch.randn(shape, generator=g))
    model.eval()
