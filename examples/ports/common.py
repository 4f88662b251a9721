"""What the example pairs share, so that each pair's diff is the porting alone: data, models, arguments.

The data are the 8x8 handwritten digits that ship with ddtrain (``ddtrain/data/digits.npz``,
1,797 images), read with numpy: a first slice for training, the next for testing; for the
nanoGPT and Hugging Face styles, token data made from a fixed seed (``token_stream``,
``token_classification``). The models are small enough for a run of a second or two on a CPU:
``Net`` (mnist's), ``BNNet`` (a ResNet-like stem with BatchNorm, for the ImageNet and timm
styles), ``TinyGPT`` (nanoGPT's GPT, two blocks) and ``TinyClassifier`` (a Hugging Face-style
sequence classifier: keyword batches in, an output with ``.loss`` and ``.logits`` out).
"""
import argparse
import math
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def digits(train_samples: int = 1200, test_samples: int = 400):
    """(train, test) TensorDatasets of (1x8x8 image in [0, 1], label)."""
    with resources.files("ddtrain.data").joinpath("digits.npz").open("rb") as f:
        arrays = np.load(f)
        x = torch.from_numpy(arrays["x"].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
        y = torch.from_numpy(arrays["y"].astype(np.int64))
    end = train_samples + test_samples
    return TensorDataset(x[:train_samples], y[:train_samples]), TensorDataset(x[train_samples:end], y[train_samples:end])


class Net(torch.nn.Module):
    """A small CNN in the shape of pytorch/examples mnist's ``Net`` (log-probabilities out)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.fc1 = torch.nn.Linear(8 * 3 * 3, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(x.flatten(1)))), dim=1)


def parser(description: str, **defaults) -> argparse.ArgumentParser:
    """The arguments every example takes (each adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=defaults.get("epochs", 3))
    p.add_argument("--batch-size", type=int, default=defaults.get("batch_size", 32))
    p.add_argument("--lr", type=float, default=defaults.get("lr", 0.1))
    p.add_argument("--train-samples", type=int, default=1200)
    p.add_argument("--test-samples", type=int, default=400)
    p.add_argument("--seed", type=int, default=1)
    return p


class BNNet(torch.nn.Module):
    """Conv-BatchNorm-ReLU twice and a linear head: BatchNorm's running statistics are what DDP broadcasts."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(1, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def token_stream(tokens: int = 6000, vocab: int = 24, seed: int = 0) -> torch.Tensor:
    """A token sequence with structure to learn: runs of a few rules (next = previous + step mod vocab), some noise."""
    g = torch.Generator().manual_seed(seed)
    out, value = [], 0
    while len(out) < tokens:
        step, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(8, 24, (1,), generator=g))
        for _ in range(length):
            value = (value + step) % vocab if torch.rand(1, generator=g) > 0.1 else int(torch.randint(vocab, (1,), generator=g))
            out.append(value)
    return torch.tensor(out[:tokens], dtype=torch.long)


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 24
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    # nanoGPT's switch, off here: the attention's key bias has a gradient that is exactly zero in arithmetic
    # (softmax ignores a shift common to all keys), so AdamW turns its rounding noise into steps of size lr,
    # which differ from one summation order to another (half the parameter apart at 3 ranks, ring against Gloo)
    bias: bool = False


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        width, bias = config.n_embd, config.bias
        self.ln_1, self.ln_2 = nn.LayerNorm(width, bias=bias), nn.LayerNorm(width, bias=bias)
        self.attn, self.proj = nn.Linear(width, 3 * width, bias=bias), nn.Linear(width, width, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=bias), nn.GELU(), nn.Linear(4 * width, width, bias=bias))
        self.n_head = config.n_head

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # no mask buffer, as nanoGPT with flash attention
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's ``GPT`` in two blocks: tied embeddings, ``forward(idx, targets)`` -> (logits, loss)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte, self.wpe = nn.Embedding(config.vocab_size, config.n_embd), nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """nanoGPT's: weight decay on the matrices only, AdamW."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


class TokenClassification(Dataset):
    """Sequences of tokens labelled 1 when token 3 occurs more often than token 5: a dict per sample, as datasets gives."""

    def __init__(self, samples: int, length: int = 12, vocab: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(vocab, (samples, length), generator=g)
        lengths = torch.randint(length // 2, length + 1, (samples,), generator=g)
        self.attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = self.input_ids * self.attention_mask
        self.labels = ((ids == 3).sum(1) > (ids == 5).sum(1)).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


def token_classification(train_samples: int = 301, eval_samples: int = 101):
    return TokenClassification(train_samples, seed=0), TokenClassification(eval_samples, seed=1)


@dataclass
class ClassifierOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class TinyClassifier(nn.Module):
    """An embedding, one transformer encoder layer and a mean-pooled head; ``forward(**batch)`` as Hugging Face's."""

    def __init__(self, vocab: int = 16, width: int = 32, labels: int = 2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, width)
        # no biases: the attention's key bias gets a gradient that is exactly zero in arithmetic (softmax ignores a
        # shift common to all keys), so AdamW turns the last bits of its rounding noise into steps of size lr,
        # which differ from one summation order to another (1 % apart at 3 ranks between ring and Gloo)
        self.encoder = nn.TransformerEncoderLayer(width, 2, 64, dropout=0.0, batch_first=True, bias=False)
        self.LayerNorm = nn.LayerNorm(width)
        self.classifier = nn.Linear(width, labels)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.encoder(self.embeddings(input_ids), src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).float()
        logits = self.classifier(self.LayerNorm((h * mask).sum(1) / mask.sum(1)))
        return ClassifierOutput(None if labels is None else F.cross_entropy(logits, labels), logits)


def linear_schedule_with_warmup(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    """transformers' ``get_linear_schedule_with_warmup`` factor (used through ``functools.partial``, as there)."""
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))


def cosine_with_warmup(it: int, warmup_iters: int, lr_decay_iters: int, learning_rate: float, min_lr: float) -> float:
    """nanoGPT's ``get_lr``."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)
