"""Which fp8 linears round their activations to E4M3 (W8A8) and which keep them in the model's dtype
(W8A16: the same E4M3 weight bytes, dequantized in registers).

Rounding activations per token to E4M3 costs more quality than rounding the weights (docs/perf/gpu.md,
"Weight formats"), and not evenly: some layers' activations matter far more to the model's output than
others'. The policy `fp8_activations`:

- all: every fp8 linear W8A8 (the fastest at large batches on fp8 tensor cores);
- none: every fp8 linear W8A16;
- auto: chosen on the calibration data. Layers are grouped by their role in a decoder layer (qkv, o,
  gate_up, down: one decision for all decoder layers, which the calibration text's few tokens can
  measure, where a decision per layer would fit its noise). For each group, the full-precision model is
  run with only that group's inputs rounded, and the KL divergence of its next-token distributions from
  the unrounded model's is the group's cost. Groups go weight-only in order of cost per weight byte
  while their bytes fit in WEIGHT_ONLY_BUDGET of the fp8 linears' bytes, since W8A8 is the faster path
  on fp8 tensor cores at large batches. Without calibration data, auto is all.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.errors import InvalidRequestError
from engine.models.llama import LlamaForCausalLM
from engine.quant.calibration import causal_prefill, first_tokens, linear_modules, lm_head_name

POLICIES = ("auto", "all", "none")
# Share of the fp8 linears' weight bytes that auto may keep weight-only.
WEIGHT_ONLY_BUDGET = 0.3
# Calibration tokens the choice runs (a forward pass per group and one reference); it comes out the
# same on 512 as on 1024 for SmolLM2 (docs/perf/gpu.md, "Weight formats").
POLICY_TOKENS = 512


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise InvalidRequestError(f"fp8_activations must be auto, all or none, got {policy!r}")
    return policy


def role(name: str) -> str:
    """A decoder linear's role, its name without the layer: `layers.3.mlp.down_proj` -> `mlp.down_proj`."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else name


@torch.inference_mode()
def group_costs(model: LlamaForCausalLM, sequences: list[list[int]], names: Iterable[str]) -> dict[str, float]:
    """Per role: mean KL (nats per token) of the model's next-token distributions with that role's
    inputs rounded per token to E4M3, from the same model's unrounded ones, on `sequences`."""
    from engine.quant.fp8 import fake_quantize_rows

    modules = linear_modules(model)
    roles: dict[str, list[str]] = {}
    for name in names:
        roles.setdefault(role(name), []).append(name)
    device = model.norm.weight.device

    def log_probs() -> list[torch.Tensor]:
        return [model.compute_logits(causal_prefill(model, seq, 16, device)).float().log_softmax(-1) for seq in sequences]

    reference = log_probs()
    tokens = sum(len(seq) for seq in sequences)
    costs = {}
    for group, members in roles.items():
        hooks = [modules[n].register_forward_pre_hook(lambda m, args: (fake_quantize_rows(args[0]), *args[1:]))
                 for n in members]
        try:
            rounded = log_probs()
        finally:
            for h in hooks:
                h.remove()
        kl = sum((p.exp() * (p - q)).sum().item() for p, q in zip(reference, rounded, strict=True))
        costs[group] = kl / tokens
    return costs


def choose_weight_only(costs: dict[str, float], group_bytes: dict[str, int],
                       budget: float = WEIGHT_ONLY_BUDGET) -> set[str]:
    """The roles that keep full-precision activations: by cost per byte, while they fit in `budget`
    of all the bytes; a role whose rounding costs nothing stays W8A8."""
    total = sum(group_bytes.values())
    chosen, spent = set(), 0
    for group in sorted(costs, key=lambda g: costs[g] / group_bytes[g], reverse=True):
        if costs[group] > 0 and spent + group_bytes[group] <= budget * total:
            chosen.add(group)
            spent += group_bytes[group]
    return chosen


def weight_only_modules(model: LlamaForCausalLM, policy: str,
                        sequences: list[list[int]] | None = None) -> tuple[frozenset[str], dict]:
    """The linears of a full-precision model that fp8 quantization under `policy` keeps weight-only
    (module names), and the record of the choice for the quant config."""
    check_policy(policy)
    head = lm_head_name(model)
    sizes = {n: m.in_features * m.out_features for n, m in linear_modules(model).items() if n != head}
    if policy == "none":
        return frozenset(sizes), {"policy": policy}
    if policy == "all" or not sequences:
        return frozenset(), {"policy": policy}
    costs = group_costs(model, first_tokens(sequences, POLICY_TOKENS), sizes)
    group_bytes: dict[str, int] = {}
    for name, size in sizes.items():
        group_bytes[role(name)] = group_bytes.get(role(name), 0) + size
    groups = choose_weight_only(costs, group_bytes)
    record = {"policy": policy, "kl_by_group": {g: round(c, 6) for g, c in sorted(costs.items())},
              "weight_only_groups": sorted(groups), "budget": WEIGHT_ONLY_BUDGET}
    return frozenset(n for n in sizes if role(n) in groups), record


def set_activations(model: torch.nn.Module, policy: str) -> int:
    """all or none: every Fp8Linear's activations so (auto keeps what the checkpoint says). Returns how many."""
    from engine.quant.fp8 import Fp8Linear

    check_policy(policy)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if policy != "auto":
        for m in layers:
            m.act_fp8 = policy == "all"
    return len(layers)


def w8a8_share(model: torch.nn.Module) -> float | None:
    """The share of the fp8 linears' weight bytes whose activations are rounded (W8A8); None without any."""
    from engine.quant.fp8 import Fp8Linear

    sizes = [(m.qweight.numel(), m.act_fp8) for m in model.modules() if isinstance(m, Fp8Linear)]
    total = sum(s for s, _ in sizes)
    return sum(s for s, a in sizes if a) / total if total else None
