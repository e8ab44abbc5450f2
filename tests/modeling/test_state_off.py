"""The state-off control: a linear layer left with its window and sinks is the teacher's own softmax under a
window-and-sinks mask, on the full-sequence and the decoding path, and the state comes back after."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from linearize.convert.swap import linearize_model
from linearize.modeling.modes import state_off, state_off_layers
from linearize.modeling.configuration_linearize import LINEAR

WINDOW, SINKS, T = 8, 2, 40


def window_and_sinks_mask(length: int) -> torch.Tensor:
    """[1, 1, T, T] additive mask: each query sees its last WINDOW keys and the first SINKS tokens, causally."""
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (k <= q) & ((k > q - WINDOW) | (k < SINKS))
    return torch.zeros(1, 1, length, length).masked_fill(~allowed, float("-inf"))


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    settings = {"kind": "gla", "feature_map": "hedgehog", "window": WINDOW, "sink": SINKS}
    student = linearize_model(teacher, [LINEAR] * teacher.config.num_hidden_layers, settings).eval()
    return teacher, student


def test_state_off_is_softmax_over_the_window_and_the_sinks(pair):
    teacher, student = pair
    ids = torch.randint(3, teacher.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = teacher(ids, attention_mask=window_and_sinks_mask(T).expand(2, 1, T, T)).logits
        on = student(ids, use_cache=False).logits
        with state_off(student):
            off = student(ids, use_cache=False).logits
        again = student(ids, use_cache=False).logits
    torch.testing.assert_close(off, reference, rtol=1e-4, atol=1e-4)
    assert (on - reference).abs().max() > 1e-2  # with its state, the student sees past the window
    torch.testing.assert_close(again, on, rtol=0, atol=0)  # the state's weight is restored on exit
    # inside the window nothing has left it: with or without the state, the same exact softmax
    torch.testing.assert_close(on[:, :WINDOW], reference[:, :WINDOW], rtol=1e-4, atol=1e-4)


def test_state_off_holds_while_decoding(pair):
    teacher, student = pair
    ids = torch.randint(3, teacher.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    prompt = 24
    with torch.no_grad(), state_off(student):
        full = student(ids, use_cache=False).logits
        out = student(ids[:, :prompt], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(prompt, T - 1):
            out = student(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, prompt - 1 : T - 1], rtol=1e-4, atol=1e-4)


def test_state_off_refuses_models_without_a_window_mix(tiny_llama_dir):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(ValueError, match="has none"):
        state_off_layers(teacher)
    performer = linearize_model(teacher, [LINEAR] * 4, {"kind": "performer", "feature_map": "performer", "window": 8})
    with pytest.raises(ValueError, match="this model's performer layers have no such mix: use it on a GLA or deltanet"):
        state_off_layers(performer)


def test_window_logit_sets_each_heads_starting_mix(tiny_linearize):
    """`window_logit` is where every head's window factor starts: sigmoid(0) = an even mix of window and state."""
    even = tiny_linearize(["linear_attention"], {"window": 4, "window_logit": 0.0})
    default = tiny_linearize(["linear_attention"], {"window": 4})
    assert torch.equal(even.linear_attentions[0].window_factor, torch.zeros(4))
    assert torch.equal(default.linear_attentions[0].window_factor, torch.full((4,), 2.0))
