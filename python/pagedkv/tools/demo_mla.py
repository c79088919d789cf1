"""``pagedkv demo --model deepseek``: a tiny random DeepSeek-V3 served on its latent cache.

The Llama demo's requests (``pagedkv.tools.demo``) run through ``LLMEngine`` with a random
``DeepseekV3ForCausalLM`` from transformers (config only, no download) wrapped by
``TransformersForCausalLM``: multi-head latent attention (q LoRA, interleaved rotary key,
absorbed attention over the paged latents), dense MLP layers. Paged with prefix caching and
contiguous under one KV budget, greedy, so both runs must produce the same tokens.

The report adds what the latent saves: its bytes per token (layers x (kv_lora_rank + rope_dim)
x element size) beside the non-absorbed MHA form's (layers x heads x (qk_nope + qk_rope +
v_head_dim) x element size) and a GQA cache of 8 KV heads of the same head dims, how many of the
demo's requests each form holds in the demo's budget, and the same bytes for DeepSeek-V3 itself
(``pagedkv.tools.presets``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

import torch

from pagedkv.tools import demo
from pagedkv.tools.presets import get_model
from pagedkv.tools.presets_mla import MLAShape, mla_report

__all__ = ["GQA_KV_HEADS", "TINY_CONFIG", "deepseek_model", "format_report", "memory_report",
           "run", "run_demo"]

GQA_KV_HEADS = 8
"""The KV heads of the GQA form the latent is compared with."""

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "first_k_dense_replace": 4, "num_attention_heads": 16, "q_lora_rank": 64,
    "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "rope_interleave": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1, "initializer_range": 0.1,
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
    "pad_token_id": None}
"""The demo's DeepseekV3Config (``max_position_embeddings`` is the demo's max_model_len): 4
dense layers, hidden 128, 16 heads, a 64 + 16 latent (q LoRA 64, head dims 16 + 16, v 16)."""

FORMS = (("latent", "latent (MLA)"), ("mha", "MHA form"), ("gqa", f"GQA-{GQA_KV_HEADS}"))


def _shape(config: dict[str, Any]) -> MLAShape:
    return MLAShape(config["q_lora_rank"] or 0, config["kv_lora_rank"],
                    config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"])


def deepseek_model(max_model_len: int, seed: int = 0) -> torch.nn.Module:
    """``TINY_CONFIG``'s DeepseekV3ForCausalLM with seeded random weights (transformers' own
    init, std 0.1), as an ``LLMEngine`` model. Raises ImportError without transformers."""
    from pagedkv.integrations.hf_engine import random_causal_lm

    return random_causal_lm("DeepseekV3Config", seed, **TINY_CONFIG,
                            max_position_embeddings=max_model_len)


def _fit(requests: list[tuple[list[int], int]], bytes_per_token: int, budget: int,
         block_size: int, max_model_len: int) -> dict[str, int]:
    """How many of ``requests`` a cache of ``bytes_per_token`` holds in ``budget``: paged (each
    at full length, prompt and output, in whole blocks; in arrival order, no prefix sharing) and
    as contiguous ``max_model_len`` reservations."""
    blocks = budget // (bytes_per_token * block_size)
    held = 0
    for prompt, max_tokens in requests:
        blocks -= -(-(len(prompt) + max_tokens) // block_size)
        if blocks < 0:
            break
        held += 1
    return {"tokens_in_budget": budget // bytes_per_token, "requests_paged": held,
            "requests_contiguous": budget // (bytes_per_token * max_model_len)}


def _forms(num_layers: int, num_heads: int, mla: MLAShape,
           element_size: int) -> dict[str, dict[str, Any]]:
    """Bytes per token of the latent, the MHA form and GQA-8, and each one's ratio to the latent
    (``mla_report``: the GQA form is the MHA form of ``GQA_KV_HEADS`` heads)."""
    full = mla_report(num_layers, num_heads, mla, element_size)
    gqa = mla_report(num_layers, GQA_KV_HEADS, mla, element_size)
    latent = full["latent_bytes_per_token"]
    sizes = {"latent": latent, "mha": full["mha_bytes_per_token"],
             "gqa": gqa["mha_bytes_per_token"]}
    return {form: {"bytes_per_token": size, "ratio": size / latent}
            for form, size in sizes.items()}


def memory_report(requests: list[tuple[list[int], int]], budget: int, block_size: int,
                  max_model_len: int, element_size: int) -> dict[str, Any]:
    """The demo model's KV forms (``_forms``, with how many requests each holds in ``budget``)
    and DeepSeek-V3's (the preset, bf16)."""
    mla = _shape(TINY_CONFIG)
    forms = _forms(TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_attention_heads"], mla,
                   element_size)
    for form in forms.values():
        form.update(_fit(requests, form["bytes_per_token"], budget, block_size, max_model_len))
    v3 = get_model("deepseek-v3")
    v3_element = v3.spec().element_size
    return {"element_size": element_size, "gqa_kv_heads": GQA_KV_HEADS, **forms,
            "deepseek_v3": {"layers": v3.num_layers, "heads": v3.num_heads,
                            "element_size": v3_element,
                            **_forms(v3.num_layers, v3.num_heads, v3.mla, v3_element)}}


def run_demo(num_requests: int = 48, system_prompt_len: int = 48, max_prompt: int = 64,
             max_tokens: int = 64, max_model_len: int = 192, kv_budget_requests: int = 6,
             block_size: int = 16, device: str = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0) -> dict[str, Any]:
    """``demo.run_demo``'s runs and report with the tiny DeepSeek-V3 on its latent cache, plus
    ``memory`` (``memory_report``). Raises ImportError without transformers."""
    if system_prompt_len + max_prompt + max_tokens > max_model_len:
        raise ValueError("system_prompt_len + max_prompt + max_tokens must be <= max_model_len")
    model = deepseek_model(max_model_len, seed).to(device=device, dtype=dtype)
    requests = demo.make_requests(num_requests, system_prompt_len, TINY_CONFIG["vocab_size"],
                                  max_prompt, max_tokens, seed)
    spec = model.kv_cache_spec(block_size, dtype)
    budget = model.kv_cache_spec(max_model_len, dtype).bytes_per_block * kv_budget_requests
    runs = demo.serve_both(model, requests, budget, spec.bytes_per_block, block_size,
                           max_model_len)
    mla = _shape(TINY_CONFIG)
    return {
        "model": {"name": "deepseek", "layers": TINY_CONFIG["num_hidden_layers"],
                  "hidden": TINY_CONFIG["hidden_size"],
                  "heads": TINY_CONFIG["num_attention_heads"], "kv_lora_rank": mla.kv_lora_rank,
                  "rope_dim": mla.qk_rope_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim,
                  "v_head_dim": mla.v_head_dim, "q_lora_rank": mla.q_lora_rank,
                  "vocab": TINY_CONFIG["vocab_size"], "dtype": str(dtype).removeprefix("torch."),
                  "device": str(device)},
        "requests": num_requests,
        "system_prompt_len": system_prompt_len,
        "max_model_len": max_model_len,
        "kv_budget_bytes": budget,
        "tp": 1,
        "memory": memory_report(requests, budget, block_size, max_model_len, spec.element_size),
        **runs,
    }


def _memory_lines(report: dict[str, Any]) -> list[str]:
    memory, model = report["memory"], report["model"]
    latent_row = model["kv_lora_rank"] + model["rope_dim"]
    head_row = model["qk_nope_head_dim"] + model["rope_dim"] + model["v_head_dim"]
    element, layers = memory["element_size"], model["layers"]
    formulas = {"latent": f"{layers} x {latent_row} x {element} B",
                "mha": f"{layers} x {model['heads']} x {head_row} x {element} B",
                "gqa": f"{layers} x {GQA_KV_HEADS} x {head_row} x {element} B"}
    lines = ["KV cache per token, and how many of the requests each form holds in the budget",
             f"(each at full length in blocks of {report['paged']['block_size']}, no prefix "
             "sharing; contiguous: max_model_len reservations):",
             f"{'':14}{'bytes per token':>30}{'ratio':>8}{'paged':>8}{'contiguous':>12}"]
    for form, label in FORMS:
        row = memory[form]
        size = f"{formulas[form]} = {row['bytes_per_token']:,}"
        lines.append(f"{label:14}{size:>30}{row['ratio']:>7.1f}x{row['requests_paged']:>8}"
                     f"{row['requests_contiguous']:>12}")
    v3 = memory["deepseek_v3"]
    lines.append(f"DeepSeek-V3 ({v3['layers']} layers, {v3['heads']} heads, "
                 f"{v3['element_size']} B elements): latent {v3['latent']['bytes_per_token']:,} "
                 f"B/token, MHA form {v3['mha']['bytes_per_token']:,} B "
                 f"({v3['mha']['ratio']:.1f}x), GQA-{GQA_KV_HEADS} "
                 f"{v3['gqa']['bytes_per_token']:,} B ({v3['gqa']['ratio']:.1f}x)")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The DeepSeek demo's report: the model, the runs' table and the memory of the KV forms."""
    model = report["model"]
    header = [
        f"model: DeepSeek-V3-style, {model['layers']} layers, hidden {model['hidden']}, "
        f"{model['heads']} heads, latent {model['kv_lora_rank']} + rope {model['rope_dim']}, "
        f"vocab {model['vocab']}, {model['dtype']} on {model['device']} (random weights)",
        demo.requests_line(report),
    ]
    return "\n".join(header + demo.table_lines(report) + _memory_lines(report))


def run(args: argparse.Namespace) -> int:
    """``pagedkv demo --model deepseek`` with ``demo.add_arguments``' options (and ``--json``):
    exit status 2 for ``--tp`` above 1 or without transformers, 1 when the runs' tokens differ."""
    if args.tp != 1:
        args.parser.error(f"argument --tp: --model deepseek runs on one rank, got {args.tp}")
    if importlib.util.find_spec("transformers") is None:
        args.parser.error("argument --model: deepseek needs transformers "
                          "(pip install 'pagedkv[hf]')")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run_demo(args.requests, args.system_prompt_len, args.max_prompt, args.max_tokens,
                      args.max_model_len, args.kv_budget_requests, args.block_size, args.device,
                      getattr(torch, args.dtype), args.seed)
    report.pop("outputs")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["outputs_match"] else 1
