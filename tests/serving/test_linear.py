"""The model's linear layers on oneDNN with prepacked weights (``model.prepack()``).

Greedy tokens equal Hugging Face's in float32; the logits' error against a float64 run of the
same weights stays within twice the error of the ``F.linear`` path; the packed copies follow
the weights (state dict loads, in-place edits); unsupported dtypes and devices are refused
before anything is packed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedkv.errors import InvalidArgumentError
from pagedkv.serving import linear
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.linear import LinearGroup, onednn_dtypes
from pagedkv.serving.model import LlamaForCausalLM

pytest.importorskip("transformers")
from test_model_hf import (  # noqa: E402, F401
    CONFIGS,
    MAX_NEW,
    PROMPTS,
    assert_bf16_logits_close,
    hf_greedy,
    hf_step_logits,
    one_thread,
    paged_generate,
    tiny_hf_model,
)

needs_onednn = pytest.mark.skipif(torch.float32 not in onednn_dtypes(),
                                  reason="PyTorch without oneDNN")
# wide enough (K = 256, 768) that oneDNN's and MKL's sums differ in their last bits
WIDE = dict(vocab_size=1000, hidden_size=256, intermediate_size=768, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.05)


@needs_onednn
@pytest.mark.parametrize("name", [*CONFIGS, "wide"])
def test_prepacked_greedy_float32_matches_hf(name: str) -> None:
    hf = tiny_hf_model(**(WIDE if name == "wide" else CONFIGS[name]))
    model = LlamaForCausalLM.from_hf(hf).prepack()
    assert model.packed_dtype == torch.float32
    ours, logits = paged_generate(model, PROMPTS, MAX_NEW)
    for i, prompt in enumerate(PROMPTS):
        assert ours[i] == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i}"
        torch.testing.assert_close(logits[:, i], hf_step_logits(hf, prompt, ours[i]),
                                   atol=1e-4, rtol=1e-4)


@needs_onednn
def test_prepacked_logits_as_accurate_as_f_linear() -> None:
    """max |packed - exact| <= 2 * max |F.linear - exact| + 1e-6, exact: HF in float64."""
    hf = tiny_hf_model(**WIDE)
    model = LlamaForCausalLM.from_hf(hf)
    greedy, plain = paged_generate(model, PROMPTS, MAX_NEW)
    _, packed = paged_generate(model.prepack(), PROMPTS, MAX_NEW, forced=greedy)
    hf64 = tiny_hf_model(**WIDE).double()
    exact = torch.stack([hf_step_logits(hf64, p, greedy[i]).double()
                         for i, p in enumerate(PROMPTS)], dim=1)
    plain_err = (plain.double() - exact).abs().max().item()
    packed_err = (packed.double() - exact).abs().max().item()
    assert 0 < plain_err < 1e-4
    assert packed_err <= 2 * plain_err + 1e-6, (packed_err, plain_err)
    assert not torch.equal(packed, plain)  # the packed path did run (other rounding)


@needs_onednn
def test_packed_copy_follows_the_weights() -> None:
    """After prepack(), a state dict load (HF's or torch's) and an in-place edit re-pack."""
    first, second = tiny_hf_model(seed=0), tiny_hf_model(seed=1)
    model = LlamaForCausalLM.from_hf(first).prepack()
    keys = list(model.state_dict())
    paged_generate(model, PROMPTS[:2], 2)  # packed copies of seed 0 in use
    model.load_hf_state_dict(second.state_dict())
    ours, _ = paged_generate(model, PROMPTS, MAX_NEW)
    assert ours == [hf_greedy(second, p, MAX_NEW) for p in PROMPTS]
    assert list(model.state_dict()) == keys  # the groups add no entries
    model.load_state_dict(LlamaForCausalLM.from_hf(first).state_dict())
    ours, _ = paged_generate(model, PROMPTS, MAX_NEW)
    assert ours == [hf_greedy(first, p, MAX_NEW) for p in PROMPTS]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    flipped, _ = paged_generate(model, PROMPTS[:1], 1)
    assert flipped[0][0] == hf_step_logits(first, PROMPTS[0], [0])[0].argmin().item()


@needs_onednn
def test_group_matches_f_linear_with_bias_and_autograd() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(96, n, bias=True) for n in (40, 24, 24)]
    group = LinearGroup(*layers)
    x = torch.randn(7, 96)
    group.pack(torch.float32)
    with torch.no_grad():
        outs = group(x)
    for out, layer in zip(outs, layers, strict=True):
        torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
    grads = group(x)  # autograd wants the weights: F.linear, so backward works
    sum(g.sum() for g in grads).backward()
    assert all(layer.weight.grad is not None for layer in layers)
    with pytest.raises(InvalidArgumentError, match="one input size"):
        LinearGroup(nn.Linear(4, 4), nn.Linear(5, 4))


def test_unsupported_dtype_refused_before_packing() -> None:
    model = LlamaForCausalLM.from_hf(tiny_hf_model())
    with pytest.raises(InvalidArgumentError, match="float16 is not supported"):
        model.prepack(torch.float16)
    assert model.packed_dtype is None
    assert all(not group.packed for group in model.linear_groups())
    with pytest.raises(InvalidArgumentError, match="on the CPU; the model is on cuda"):
        linear.check_packable(torch.device("cuda"), torch.float32)


def test_bfloat16_weights_where_supported() -> None:
    """bf16 packs where the CPU has native bf16 (logits as close as HF's own bf16, x2),
    a clear error elsewhere."""
    hf = tiny_hf_model(**CONFIGS["gqa"])
    model = LlamaForCausalLM.from_hf(hf)
    if torch.bfloat16 not in onednn_dtypes():
        with pytest.raises(InvalidArgumentError, match="bfloat16 is not supported .* AMX"):
            model.prepack(torch.bfloat16)
        assert model.packed_dtype is None
        return
    greedy, _ = paged_generate(model, PROMPTS, MAX_NEW)
    _, ours = paged_generate(model.prepack(torch.bfloat16), PROMPTS, MAX_NEW, forced=greedy)
    assert_bf16_logits_close(hf, ours, greedy)


@needs_onednn
def test_engine_same_tokens_packed_and_unpacked() -> None:
    hf = tiny_hf_model(seed=2, **WIDE)
    model = LlamaForCausalLM.from_hf(hf)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = LLMEngine(model, EngineConfig(num_blocks=64)).generate(PROMPTS, params)
    packed = LLMEngine(model.prepack(), EngineConfig(num_blocks=64)).generate(PROMPTS, params)
    assert packed == plain == [hf_greedy(hf, p, 6) for p in PROMPTS]
    assert model.unpack().packed_dtype is None
