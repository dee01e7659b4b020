"""FusedMoE: the routed experts of a mixture-of-experts block, all experts' weights in two stacked parameters
(w13_weight [E, 2 * I, H]: gate rows then up rows; w2_weight [E, H, I]), the Triton grouped GEMM on CUDA and one
matmul pair per active expert elsewhere.

With tensor parallelism each rank holds every expert's slice of the intermediate dim (I / tp_size: its gate and up
rows, its down columns), as vLLM splits experts, and the ranks' partial sums are added in one all-reduce. FP8
experts load in fp8 with their scales and are dequantized after loading (fp8_moe.py)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import use_triton
from pagedllm.layers.activation import activation_fn
from pagedllm.layers.build_context import current_build_context, divide
from pagedllm.layers.fused_moe.fp8_moe import create_fp8_expert_weights, dequantize_experts, expert_fp8_strategy
from pagedllm.layers.fused_moe.routing import check_routing, select_experts
from pagedllm.layers.fused_moe.torch_moe import fused_experts_torch
from pagedllm.layers.linear import default_weight_loader, new_param
from pagedllm.layers.quantization import QuantizationConfig

# checkpoint projection name -> shard of the stacked parameters: "w1" gate, "w3" up (both in w13), "w2" down
SHARD_NAMES = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_stacked_params(
    num_experts: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), module: str = "experts"
) -> list[tuple[str, str, object]]:
    """`load_weights` stacked entries for per-expert checkpoint tensors: `{module}.{e}.{gate|up|down}.` ->
    `{module}.w13_` / `{module}.w2_` with shard id (e, "w1" | "w3" | "w2"). `names` are the checkpoint's
    (gate, up, down) names: ("w1", "w3", "w2") for Mixtral. Put these before the dense STACKED_PARAMS, whose
    `.gate_proj.` would match an expert's name too."""
    gate, up, down = names
    entries: list[tuple[str, str, object]] = []
    for e in range(num_experts):
        entries.append((f".{module}.w13_", f".{module}.{e}.{gate}.", (e, "w1")))
        entries.append((f".{module}.w13_", f".{module}.{e}.{up}.", (e, "w3")))
        entries.append((f".{module}.w2_", f".{module}.{e}.{down}.", (e, "w2")))
    return entries


class FusedMoE(nn.Module):
    """forward(x [n, H], router_logits [n, E]) -> [n, H]: each token through its top_k experts (see
    `select_experts` for the routing options), weighted and summed."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        activation: str = "silu",
        scoring_func: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.fp8_strategy = expert_fp8_strategy(quant_config, prefix or "FusedMoE")  # None: float experts
        context = current_build_context()
        self.tp_rank, self.tp_size, self.tp_group = context.tp_rank, context.tp_size, context.tp_group
        intermediate_size = divide(intermediate_size, self.tp_size, "moe_intermediate_size")  # this rank's
        check_routing(num_experts, top_k, scoring_func, num_expert_group, topk_group)
        activation_fn(activation)  # refuses an unknown name now
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.scoring_func = activation, scoring_func
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        # [E] float32 or None: owned by the caller (the router's loaded parameter), so kept out of this module's
        # parameters: the checkpoint names it under the router
        self.__dict__["e_score_correction_bias"] = e_score_correction_bias
        self.compute_dtype = torch.get_default_dtype()
        if self.fp8_strategy is not None:
            create_fp8_expert_weights(self, self.fp8_strategy)
            return
        loader = self.weight_loader
        self.w13_weight = new_param(num_experts, 2 * intermediate_size, hidden_size, weight_loader=loader)
        self.w2_weight = new_param(num_experts, hidden_size, intermediate_size, weight_loader=loader)

    def process_weights_after_loading(self) -> None:
        if self.fp8_strategy is not None:  # FP8 experts: dequantized once (fp8_moe.py)
            dequantize_experts(self, self.compute_dtype)
            self.fp8_strategy = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """shard_id (expert, "w1" | "w3" | "w2") copies this rank's part of one expert's projection [rows, cols]
        into its slice; None copies a whole stacked tensor (a checkpoint that stores the experts fused: [E, 2I, H]
        or [E, H, I])."""
        inter = self.intermediate_size  # this rank's
        if shard_id is None:
            if param is self.w2_weight:
                default_weight_loader(param, loaded.narrow(2, self.tp_rank * inter, inter))
                return
            full = loaded.shape[1] // 2
            for index, shard in enumerate(("w1", "w3")):
                part = loaded.narrow(1, index * full, full)
                for expert in range(self.num_experts):
                    self.weight_loader(param, part[expert], (expert, shard))
            return
        expert, shard = shard_id
        target = param.data[expert]  # [2 * I, H] or [H, I]
        if shard == "w1":
            target = target[:inter]
        elif shard == "w3":
            target = target[inter:]
        dim = 1 if shard == "w2" else 0  # down: its input columns; gate, up: their output rows
        default_weight_loader(target, loaded.narrow(dim, self.tp_rank * inter, inter))

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(
            router_logits,
            self.top_k,
            self.renormalize,
            self.scoring_func,
            self.num_expert_group,
            self.topk_group,
            self.routed_scaling_factor,
            self.e_score_correction_bias,
        )

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(router_logits)  # [n, top_k] each
        if use_triton(x) and self.activation in ("silu", "swish"):
            from pagedllm.layers.fused_moe.triton_moe import fused_experts_triton

            out = fused_experts_triton(x, self.w13_weight, self.w2_weight, weights, ids)
        else:
            out = fused_experts_torch(x, self.w13_weight, self.w2_weight, weights, ids, self.activation)
        if self.tp_size > 1:
            self.tp_group.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, scoring={self.scoring_func}"
        )
