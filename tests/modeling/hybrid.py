"""Helpers shared by the hybrid model's tests (test_modeling, test_generation, test_cache, test_decoding): tiny
random models with their new parameters off their identity init, the forms switch, padded batches, the
plans cached generation is checked on, and greedy decoding by recomputation."""

from __future__ import annotations

import torch
from conftest import make_tiny_linearize

from linearize.modeling.modeling_linearize import LinearAttention, LinearizeForCausalLM

LIN, FULL = "linear_attention", "full_attention"
VOCAB = 128
DELTA = {"kind": "deltanet", "feature_map": "identity", "normalize": False, "gate": "lowrank"}
DELTA_NORMALIZED = {"kind": "deltanet", "feature_map": "hedgehog", "normalize": True, "gate": "lowrank"}
PLANS = {
    "linear": ([LIN, FULL, LIN], {"chunk_size": 16}),
    "window": ([LIN, FULL, LIN], {"window": 4, "chunk_size": 16}),
    "window_sinks": ([LIN, FULL, LIN], {"window": 4, "sink": 3, "chunk_size": 16}),
    "window_sinks_unrotated": ([LIN, FULL, LIN], {"window": 4, "sink": 3, "chunk_size": 16, "rope_features": False}),
    "linear_unrotated": ([LIN, FULL, LIN], {"chunk_size": 16, "rope_features": False}),
    "all_linear": ([LIN, LIN, LIN], {"chunk_size": 16}),
    "deltanet_window_sinks_conv": ([LIN, FULL, LIN], {**DELTA, "window": 4, "sink": 2, "conv_size": 4, "chunk_size": 16}),
    "deltanet_normalized_window_sinks": ([LIN, FULL, LIN], {**DELTA_NORMALIZED, "window": 4, "sink": 2, "chunk_size": 16}),
    "gla_taylor_retnet": ([LIN, FULL, LIN], {"feature_map": "taylor", "feature_dim": 4, "gate": "retnet", "chunk_size": 16}),
    "all_hybrid_performer": ([LIN, LIN, LIN], {"kind": "performer", "feature_map": "performer", "window": 4}),
}
PROMPT = 21  # > RECURRENT_MAX_TOKENS (prefill takes the chunked path), > window, not a multiple of the chunk
NEW = 24


@torch.no_grad()
def randomize_new_parameters(model: LinearizeForCausalLM, seed: int = 0) -> None:
    """Give the linear layers' own parameters non-trivial values, so the test exercises them.

    The low-rank gate gets log-decays spread from ~0 down past the MIN_LOG_DECAY clamp (decays
    vary per token, head and channel), Hedgehog maps move off identity, window mixes off 0.5.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, dtype=p.dtype)

    for module in model.modules():
        if not isinstance(module, LinearAttention):
            continue
        if module.gate is not None:
            module.gate.up.weight.copy_(rand(module.gate.up.weight) * 2.0)
            module.gate.up.bias.copy_(torch.rand(module.gate.up.bias.shape, generator=gen) * -100.0 + 10.0)
        for name in ("feature_map_q", "feature_map_k"):
            fmap = getattr(module, name, None)
            if fmap is not None:
                fmap.weight.add_(rand(fmap.weight) * 0.3)
                if hasattr(fmap, "bias"):
                    fmap.bias.copy_(rand(fmap.bias) * 0.3)
        if hasattr(module, "write_strength"):  # delta rule write strengths from ~0 to ~1
            module.write_strength.proj.weight.copy_(rand(module.write_strength.proj.weight) * 2.0)
            module.write_strength.proj.bias.copy_(rand(module.write_strength.proj.bias))
        if hasattr(module, "conv"):
            module.conv.weight.add_(rand(module.conv.weight) * 0.3)
        if hasattr(module, "window_factor"):
            module.window_factor.copy_(rand(module.window_factor))


def make_model(layer_types, linear_attention, seed: int = 0, **overrides) -> LinearizeForCausalLM:
    model = make_tiny_linearize(layer_types, linear_attention, seed=seed, **overrides)
    randomize_new_parameters(model, seed)
    return model


def set_form(model: torch.nn.Module, form: str | None) -> None:
    for module in model.modules():
        if isinstance(module, LinearAttention):
            module.form = form


def forward_backward(model, ids, mask, weights, form):
    """Logits and the gradients of a fixed random projection of them, with every linear layer in `form`."""
    set_form(model, form)
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    (logits * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    set_form(model, None)
    return logits.detach(), grads


def assert_forms_equal(model, ids, mask=None, forms=("chunk", "recurrent")):
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(*ids.shape, VOCAB, generator=gen) * valid[..., None]
    ref_logits, ref_grads = forward_backward(model, ids, mask, weights, "parallel")
    assert torch.isfinite(ref_logits[valid]).all()
    # every parameter takes part: the new ones (gates, feature maps, window mix) included
    missing = [name for name, p in model.named_parameters() if name not in ref_grads]
    assert not missing, f"no gradient reaches {missing}"
    for form in forms:
        logits, grads = forward_backward(model, ids, mask, weights, form)
        torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-5, atol=1e-5, msg=lambda m: f"{form}: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(
                grads[name], ref, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{form}, grad of {name}: {m}"
            )


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenizer-free left padding: (input_ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_by_recomputation(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding that recomputes the whole sequence every step (no cache)."""
    seq, all_logits = ids, []
    for _ in range(steps):
        logits = model(seq, use_cache=False).logits[:, -1]
        all_logits.append(logits)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=-1)
    return seq[:, ids.shape[1] :], all_logits
