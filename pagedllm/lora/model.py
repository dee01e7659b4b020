"""LoRAModel: the model's linear layers wrapped for LoRA, and an adapter's tensors laid out for their slots."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import LinearBase
from pagedllm.lora.layers import LoRALayerWeights, LoRALinearMethod
from pagedllm.lora.peft_adapter import PEFTAdapter
from pagedllm.models.utils import STACKED_PARAMS, stacked_name

# layer name -> (A [S * R, in], B [out, R]) in the LoRA dtype: one adapter ready for a slot
SlotWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAModel:
    """model: this rank's; whole: the same model with every pipeline stage's layers, on the meta device (None: one
    stage), against which adapters are checked, so that every stage refuses an adapter that does not fit any stage
    (the driver checks it when it is added; the others load only their own layers' parts)."""

    def __init__(
        self, model: nn.Module, max_loras: int, rank: int, dtype: torch.dtype, device, whole: nn.Module | None = None
    ) -> None:
        self.rank, self.dtype = rank, dtype
        self.architecture = type(model).__name__
        self.stacked = getattr(model, "stacked", STACKED_PARAMS)
        self.rename = getattr(model, "rename", None)
        self.layers: dict[str, LoRALayerWeights] = {}
        skip = tuple(getattr(model, "lora_skip_prefixes", ()))  # parts adapters never touch (a vision tower)
        # on a GPU the adapter terms run on a stream of their own, beside the base layers' GEMMs (lora/layers.py)
        device = torch.device(device)
        side = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and not name.startswith(skip):
                module.lora = self.layers[name] = LoRALayerWeights(module, max_loras, rank, dtype, device)
                module.quant_method = LoRALinearMethod(module.quant_method, side)
        # every stage's layers (their shapes on the meta device), which adapters are checked against
        self.checked = self.layers
        if whole is not None:
            self.checked = {
                name: LoRALayerWeights(module, 1, rank, dtype, "meta")
                for name, module in whole.named_modules()
                if isinstance(module, LinearBase) and not name.startswith(skip)
            }
        # the module names an adapter may target (the checkpoint's: q_proj ... as well as ours)
        self.target_names = {name.rsplit(".", 1)[-1] for name in self.checked}
        self.target_names |= {
            theirs.strip(".") for ours, theirs, _ in self.stacked if ours.strip(".") in self.target_names
        }

    def locate(self, module: str) -> tuple[str, int] | None:
        """(our layer's name, its slice) of an adapter's target module name (the checkpoint's), None: no layer.
        An adapter made on the task model ("model.layers...") also fits the bare decoder ("layers...")."""
        for candidate in (module, module.removeprefix("model.")):
            name = f"{candidate}.weight"
            name = self.rename(name) if self.rename is not None else name
            name, shard_id = stacked_name(f".{name}", self.stacked)  # (the entries match ".q_proj." with its dots)
            name = name[1:].removesuffix(".weight")
            layer = self.checked.get(name)
            if layer is not None and shard_id in layer.shard_ids:
                return name, layer.shard_ids.index(shard_id)
        return None

    def check_targets(self, adapter: PEFTAdapter) -> None:
        targets = adapter.config.get("target_modules")
        if isinstance(targets, list | tuple | set):
            missing = sorted(t for t in targets if t not in self.target_names)
            if missing:
                raise ValueError(
                    f"lora_path={adapter.path!r}: target_modules {missing} are not linear layers of "
                    f"{self.architecture} (LoRA applies to {sorted(self.target_names)})"
                )

    def slot_weights(self, adapter: PEFTAdapter, pin: bool = False) -> SlotWeights:
        """The adapter's tensors per layer, zero-padded to the slots' rank, scaling folded into B (raises
        ValueError for a module the model lacks or a shape that does not fit: another base model)."""
        self.check_targets(adapter)
        out: SlotWeights = {}
        for module, (a, b, scaling) in adapter.modules.items():
            located = self.locate(module)
            if located is None:
                raise ValueError(
                    f"lora_path={adapter.path!r}: target module {module!r} is not a linear layer of "
                    f"{self.architecture} (LoRA applies to {sorted(self.target_names)})"
                )
            name, index = located
            layer = self.checked[name]
            start, rows = layer.slices[index]
            part = layer.rank_part(index, a, b)  # (this rank's, with tensor parallelism)
            if part is None:
                raise ValueError(
                    f"lora_path={adapter.path!r}: module {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                    f"the base model's layer takes [r, {layer.full_input}] and [{layer.full_rows[index]}, r] "
                    "(another base model?)"
                )
            if name not in self.layers:  # another pipeline stage's layer (checked above)
                continue
            a, b = part
            if name not in out:
                num_slices = len(layer.slices)
                out[name] = (
                    torch.zeros(num_slices * self.rank, layer.input_size, dtype=self.dtype),
                    torch.zeros(int(layer.b.shape[1]), self.rank, dtype=self.dtype),
                )
            a_slots, b_slots = out[name]
            r = a.shape[0]
            a_slots[index * self.rank : index * self.rank + r] = a.to(self.dtype)
            b_slots[start : start + rows, :r] = (b * scaling).to(self.dtype)
        if pin:
            out = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in out.items()}
        return out

    def load_slot(self, slot: int, weights: SlotWeights) -> None:
        for name, layer in self.layers.items():
            layer.set_slot(slot, weights.get(name))
