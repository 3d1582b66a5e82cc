"""Decoder layers kept in host memory and streamed to the device one at a time.

:class:`OffloadedLayers` keeps the first K layers on the device and streams the others in from
pinned host memory on a side CUDA stream into two reused device buffers: layer i+1 is copied
while layer i computes. Events order each copy after the last use of its buffer, and each
layer's compute after its copy. On CPU the same loop runs with plain host tensors.

Users: the LLM judge (:mod:`rollpacker.reward.judge`, K chosen per batch) and, with ``train.offload``,
the trainer's frozen native models, the KL reference and the distillation teacher (:class:`StreamedModel`,
K = 0: two layers on the device at most).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from rollpacker.model.args import ModelArgs
from rollpacker.model.attention import AttentionBackend
from rollpacker.model.transformer import Block, Transformer, rope_cos_sin


class OffloadedLayers:
    """A model's decoder layers run in order, the first ``num_resident`` on ``device`` and the others
    streamed in from host memory (pinned on CUDA) through reused device buffers.

    Every layer's weights live on the host as one flat tensor, so changing K moves no host memory:
    a layer that becomes resident is uploaded, one that stops being resident is dropped.
    """

    def __init__(self, blocks: Sequence[Block], args: ModelArgs, device: torch.device | str):
        self.args = args
        self.device = torch.device(device)
        self.spec = [(name, p.shape) for name, p in blocks[0].named_parameters()]
        dtypes = {p.dtype for b in blocks for p in b.parameters()}
        if len(dtypes) != 1:
            raise ValueError(f"judge layers mix dtypes {sorted(map(str, dtypes))}; set judge.dtype to one")
        pin = self.device.type == "cuda"
        self.host = [self._flatten(b, pin) for b in blocks]  # [num_layers] x [layer_numel]
        self.resident: list[Block] = []  # layers 0..K-1 on the device
        self.buffers: list[torch.Tensor] = []  # streaming buffers [layer_numel] on the device: two, or one
        self.slots: list[Block] = []  # a layer viewing each buffer
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.copied = [torch.cuda.Event() for _ in range(2)] if self.copy_stream else []
        self.used = [torch.cuda.Event() for _ in range(2)] if self.copy_stream else []

    @staticmethod
    def _flatten(block: Block, pin: bool) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1) for p in block.parameters()])
        return flat.pin_memory() if pin else flat

    def _block_on(self, flat: torch.Tensor) -> Block:
        """A decoder layer whose parameters are views of ``flat`` (so copying into it loads weights)."""
        with torch.device("meta"):
            block = Block(self.args)
        views, offset = {}, 0
        for name, shape in self.spec:
            views[name] = flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        block.load_state_dict(views, assign=True)
        return block.requires_grad_(False)

    def __len__(self) -> int:
        return len(self.host)

    @property
    def num_resident(self) -> int:
        return len(self.resident)

    @property
    def layer_bytes(self) -> int:
        return self.host[0].numel() * self.host[0].element_size()

    def device_bytes(self) -> int:
        """Bytes of layer weights held on the device now (resident layers and streaming buffers)."""
        return (len(self.resident) + len(self.buffers)) * self.layer_bytes

    def set_resident(self, k: int) -> None:
        """Keep layers 0..k-1 on the device and stream the rest."""
        if not 0 <= k <= len(self):
            raise ValueError(f"judge.resident_layers must be in 0..{len(self)}, got {k}")
        del self.resident[k:]
        while len(self.resident) < k:  # on CPU .to() is a no-op: the layer shares the host tensor
            self.resident.append(self._block_on(self.host[len(self.resident)].to(self.device, non_blocking=True)))
        num_buffers = min(2, len(self) - k)
        if len(self.buffers) != num_buffers:
            self.buffers = [torch.empty_like(self.host[0], device=self.device) for _ in range(num_buffers)]
            self.slots = [self._block_on(b) for b in self.buffers]

    def _prefetch(self, i: int) -> None:
        """Start copying streamed layer ``i`` into its buffer, once the buffer's last reader is done."""
        s = (i - len(self.resident)) % len(self.buffers)
        if self.copy_stream is None:
            self.buffers[s].copy_(self.host[i])
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.used[s])
            self.buffers[s].copy_(self.host[i], non_blocking=True)
            self.copied[s].record(self.copy_stream)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] through every layer, as ``Transformer.forward`` runs them."""
        k, n = len(self.resident), len(self)
        if k < n:
            self._prefetch(k)  # overlaps the resident layers
        for i, block in enumerate(self.resident):
            x = block(x, cos, sin, i, attn)
        for i in range(k, n):
            s = (i - k) % len(self.buffers)
            if i + 1 < n:
                self._prefetch(i + 1)  # overlaps layer i
            if self.copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied[s])
            x = self.slots[s](x, cos, sin, i, attn)
            if self.copy_stream is not None:
                self.used[s].record(torch.cuda.current_stream(self.device))
        return x


class StreamedModel(nn.Module):
    """A frozen :class:`Transformer` for inference: embedding, final norm and output head on
    ``device``, every decoder layer streamed from host memory. Called like the Transformer."""

    logit_softcap = None

    def __init__(self, model: Transformer, device: torch.device | str):
        super().__init__()
        model.requires_grad_(False)
        self.args = model.args
        blocks = list(model.layers)
        self.layers = OffloadedLayers(blocks, model.args, device)  # not a submodule: host memory
        self.layers.set_resident(0)
        del model.layers
        self.model = model.to(device)
        self.model.tie_weights()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.model.inv_freq, x.dtype)
        x = self.model.norm(self.layers(x, cos, sin, attn))
        return x if head is None else head(x, self.model.lm_head.weight)
