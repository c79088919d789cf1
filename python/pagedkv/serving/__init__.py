"""Layer 4, serving: a Llama model over the paged cache, the scheduler (continuous batching,
admission, preemption by swap or recompute) and the engine that runs it.

May import ``pagedkv.blocks``, ``pagedkv.cache``, ``pagedkv.ops`` and the base modules; never
tools. Nothing here imports transformers (``LlamaForCausalLM.from_hf`` takes a model object).
"""
