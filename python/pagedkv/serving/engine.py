"""The serving loop, and the engine that runs it with a model over the paged KV cache.

``ServingLoop`` is the one loop of continuous batching: requests come in with an arrival time,
each ``step()`` asks the ``Scheduler`` for a batch, runs it (``run_batch``), and records what
happened (tokens, first-token and finish times, preemptions, KV waste) on the loop's clock.
``LLMEngine`` runs batches with a real model and measures each step's wall time; the simulator
(``pagedkv.tools.sim``) prices them with a cost model instead. Both share the scheduler, the
block manager and the request record, so their decisions are the same on the same trace.

Bad requests are refused at ``add_request`` (``generate`` checks its whole batch before queueing
any of it), so one client's token ids cannot stop the others. A step that raises (a failing
kernel, say) keeps its scheduled batch in flight: the next ``step()`` applies the rest of the
cache plan and runs the same batch, so nothing is lost or generated twice. Like the block manager,
the loop is driven by one thread.

Under tensor parallelism every rank runs its own ``LLMEngine`` over its shard of the model and
its own cache: the same scheduler on the same requests decides the same steps on every rank
(the KV budget is the smallest rank's), and rank 0's sampled tokens are broadcast so that every
replica appends the same tokens (``pagedkv.serving.parallel``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from pagedkv import checks
from pagedkv.blocks.batch import BatchTensors
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor, cpu_cache_for
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.parallel import TensorParallel
from pagedkv.serving.scheduler import (
    EngineConfig,
    EngineStats,
    Request,
    SamplingParams,
    Scheduler,
    Status,
    StepShape,
)

__all__ = ["CausalLM", "EngineConfig", "EngineStats", "LLMEngine", "Request", "SamplingParams",
           "ServingLoop", "Status", "StepShape"]


class CausalLM(Protocol):
    """What ``LLMEngine`` asks of its model: ``pagedkv.serving.model.LlamaForCausalLM``, or any
    transformers causal LM as ``pagedkv.integrations.hf_engine.TransformersForCausalLM``.

    ``config`` has ``vocab_size``, ``max_position_embeddings`` and ``eos_token_id``; ``tp`` is
    the model's rank among tensor-parallel ranks. A call takes the flat query tokens of a batch
    and their positions, writes their K/V to the cache and returns the logits of the tokens at
    ``logits_indices``.
    """

    config: Any
    tp: TensorParallel

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype,
                      cache_dtype: torch.dtype | str | None = None) -> KVCacheSpec: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def eval(self) -> nn.Module: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                 batch: BatchTensors, logits_indices: torch.Tensor | None = None,
                 ) -> torch.Tensor: ...


class ServingLoop:
    """Continuous batching over a BlockManager; subclasses say how a batch runs (``run_batch``).

    Args:
        config: cache and scheduler settings (``num_blocks`` must be resolved).
        vocab_size: token ids must be below it (None: any id in [0, 2**63)).
        max_positions: the longest request (prompt + output) the model takes (None: no limit).
        eos_token_id: a generated token that ends a request unless ``ignore_eos`` (None: none).
        groups: the model's KV cache groups' windows (``spec.group_windows``; None: one group of
            full attention): several groups or a window make the manager a
            ``HybridBlockManager``.
    """

    def __init__(self, config: EngineConfig, vocab_size: int | None = None,
                 max_positions: int | None = None, eos_token_id: int | None = None,
                 groups: Sequence[int | None] | None = None) -> None:
        self.config = config
        if config.num_blocks is None:
            raise InvalidArgumentError("config.num_blocks must be set for a ServingLoop")
        self.manager = BlockManager(config.num_blocks, config.block_size,
                                    num_cpu_blocks=config.num_cpu_blocks,
                                    enable_prefix_caching=config.enable_prefix_caching,
                                    reserve_null_block=config.reserve_null_block, groups=groups)
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self._eos_token_id = eos_token_id
        self.stats = EngineStats()
        self.scheduler = Scheduler(config, self.manager, self.stats)
        self.clock = 0.0  # seconds: the sum of the step times so far
        self.last_batch: list[tuple[int, int]] = []  # (request id, query tokens) of the last step
        self.last_shape: StepShape | None = None
        self.last_seconds = 0.0
        self._ids = itertools.count()
        self._in_flight: list[tuple[Request, int]] | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) the device pool can hold: every KV cache
        group holds its prompt's blocks until the prefill has run."""
        num_groups = len(self.manager.group_windows)
        return self.manager.allocator.num_usable_blocks // num_groups * self.config.block_size

    @property
    def prefix_hit_rate(self) -> float:
        prefix = self.manager.prefix_cache
        return prefix.stats.hit_rate if prefix is not None else 0.0

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        """Queue a request; it joins the running batch at a coming step. ``arrival_time``
        (default: now, the loop's clock) is when its latency starts.

        Raises InvalidArgumentError, queueing nothing, for a prompt that is empty, not integer
        token ids, holds an id outside the model's vocabulary, or with ``params.max_tokens`` does
        not fit the cache or the model's positions."""
        prompt, params = self._check_request(prompt, params)
        if arrival_time is not None:
            checks.number(arrival_time, "arrival_time", at_least=0)
        return self._queue(prompt, params, self.clock if arrival_time is None else arrival_time)

    def _check_request(self, prompt: Sequence[int], params: SamplingParams | None,
                       name: str = "prompt") -> tuple[list[int], SamplingParams]:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {params!r}")
        prompt = checks.token_ids(prompt, name, self.vocab_size)
        if not prompt:
            raise InvalidArgumentError(f"{name} is empty; a request needs at least one token")
        total = len(prompt) + params.max_tokens
        limit = self.max_request_tokens
        if self.max_positions is not None:
            limit = min(limit, self.max_positions)
        if total > limit:
            raise InvalidArgumentError(
                f"{name}: a request of {len(prompt)} + {params.max_tokens} tokens exceeds the "
                f"cache ({self.max_request_tokens} tokens) or the model's positions "
                f"({self.max_positions})")
        return prompt, params

    def _queue(self, prompt: list[int], params: SamplingParams, arrival_time: float) -> Request:
        request = Request(next(self._ids), prompt, params, arrival_time=float(arrival_time))
        self.scheduler.waiting.append(request)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.scheduler)

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it.

        If it raises after scheduling (the cache plan or the model failed), the batch stays in
        flight and the next call runs it again before scheduling anything new."""
        start = time.perf_counter()
        if self._in_flight is None:
            scheduled = self.scheduler.schedule()
            if not scheduled:
                raise RuntimeError("no request could be scheduled: the cache is too small")
            self._in_flight = scheduled
        scheduled = self._in_flight
        requests = [request for request, _ in scheduled]
        query_lens = [q for _, q in scheduled]
        shape = StepShape.of([r.context_len for r in requests], query_lens,
                             self.manager.num_pending_swaps)
        next_tokens, seconds = self.run_batch(requests, query_lens, shape, start)
        self._in_flight = None
        self.last_batch = [(r.request_id, q) for r, q in scheduled]
        self.last_shape, self.last_seconds = shape, seconds
        self.clock += seconds
        self.stats.seconds += seconds
        self.stats.swapped_blocks += shape.swap_blocks
        self._record(requests)
        finished = [r for r, t in zip(requests, next_tokens, strict=True)
                    if r.prefill_end is None and self._append(r, t)]
        for request in finished:
            request.finish_time = self.clock
            self.scheduler.finish(request)
        return finished

    def run_batch(self, requests: list[Request], query_lens: list[int], shape: StepShape,
                  start: float) -> tuple[list[int], float]:
        """Apply the manager's pending plan, compute the batch; return each request's next token
        and the step's time in seconds (``start``: perf_counter at the step's start)."""
        raise NotImplementedError

    def _count_cascades(self, batch: BatchTensors) -> int:
        """Counts the batch's cascades in ``stats``; returns the key rows (per layer and kv
        head, summed over its groups) they do not read."""
        plans = [plan for plan in batch.group_cascades if plan is not None]
        if not plans:
            return 0
        saved = sum(plan.shared_tokens_saved for plan in plans)
        self.stats.cascade_steps += 1
        self.stats.cascade_saved_tokens += saved
        return saved

    def _append(self, request: Request, token: int) -> bool:
        if not request.output_token_ids:
            request.first_token_time = self.clock
        request.output_token_ids.append(token)
        self.stats.generated_tokens += 1
        hit_eos = token == self.eos_token_id and not request.params.ignore_eos
        return hit_eos or len(request.output_token_ids) >= request.params.max_tokens

    def _record(self, requests: list[Request]) -> None:
        stats, size = self.stats, self.config.block_size
        stats.steps += 1
        stats.running_sum += len(requests)
        stats.peak_running = max(stats.peak_running, len(requests))
        stats.used_slots += self.manager.allocator.num_used_blocks * size
        # a table holds exactly the blocks its tokens need: the empty slots are in the last one
        stats.empty_slots += sum(-r.context_len % size for r in requests)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[list[int]]:
        """Run prompts to completion; the output tokens of each, in order.

        The whole batch is checked before any of it is queued: one bad prompt (or a params list
        of another length) raises InvalidArgumentError and queues nothing."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError(
                f"prompts must be a sequence of prompts, got {type(prompts).__name__}")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif not isinstance(params, Sequence) or len(params) != len(prompts):
            raise InvalidArgumentError(
                f"params must be one SamplingParams or one per prompt ({len(prompts)}), got "
                f"{len(params) if isinstance(params, Sequence) else type(params).__name__}")
        checked = [self._check_request(p, s, f"prompts[{i}]")
                   for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
        requests = [self._queue(p, s, self.clock) for p, s in checked]
        while self.has_unfinished():
            self.step()
        return [r.output_token_ids for r in requests]


class LLMEngine(ServingLoop):
    """Generates for many requests at once with ``model`` over a paged KV cache.

    ``model``: a ``CausalLM``, the hand-written ``LlamaForCausalLM`` (Llama, Mistral; tensor
    parallel, prepacked linears) or ``TransformersForCausalLM`` (any transformers decoder with
    full and sliding-window layers: gpt-oss, Gemma 2/3, Qwen2, ...).

    ``config.kv_cache_bytes`` is the KV memory of each tensor-parallel rank; every rank takes the
    smallest rank's block count, and must be given the same requests in the same order.

    Example
    -------
    >>> engine = LLMEngine(LlamaForCausalLM.from_hf(hf_model), EngineConfig(num_blocks=128))
    >>> outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    """

    def __init__(self, model: CausalLM, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        param = next(model.parameters())
        spec = model.kv_cache_spec(config.block_size, param.dtype, config.cache_dtype)
        num_blocks = config.num_blocks
        if config.kv_cache_bytes is not None:  # per rank
            num_blocks = spec.num_blocks_for(config.kv_cache_bytes)
        num_blocks = model.tp.min_int(num_blocks)  # the smallest rank's count, on every rank
        if num_blocks < 1 + config.reserve_null_block:
            raise InvalidArgumentError(f"a KV budget of {num_blocks} block(s) of "
                                       f"{spec.bytes_per_block} bytes holds no request")
        if num_blocks != config.num_blocks:
            config = dataclasses.replace(config, num_blocks=num_blocks, kv_cache_bytes=None)
        super().__init__(config, model.config.vocab_size, model.config.max_position_embeddings,
                         model.config.eos_token_id, spec.group_windows)
        self.model = model.eval()
        self.tp = model.tp
        self.device = param.device
        self.cache = PagedKVCache(spec, num_blocks, self.device)
        self.cpu_cache = (cpu_cache_for(self.cache, config.num_cpu_blocks)
                          if config.num_cpu_blocks else None)
        self.executor = PlanExecutor(self.cache, self.cpu_cache)
        self.cascade = config.cascade_policy  # plans each step's shared-prefix attention
        self.generator = torch.Generator(self.device).manual_seed(config.seed)

    @property
    def eos_token_id(self) -> int | None:
        return self.model.config.eos_token_id

    def run_batch(self, requests: list[Request], query_lens: list[int], shape: StepShape,
                  start: float) -> tuple[list[int], float]:
        batch = self.manager.build_batch([r.request_id for r in requests], query_lens,
                                         device=self.device, cascade=self.cascade)
        self._count_cascades(batch)
        tokens = [r.token_ids[:r.context_len] for r in requests]
        input_ids = [t for seq, q in zip(tokens, query_lens, strict=True) for t in seq[-q:]]
        positions = [p for seq, q in zip(tokens, query_lens, strict=True)
                     for p in range(len(seq) - q, len(seq))]
        self.executor.run(self.manager)
        with torch.inference_mode():
            logits = self.model(torch.tensor(input_ids, device=self.device),
                                torch.tensor(positions, device=self.device), self.cache, batch,
                                batch.query_start_loc[1:].long() - 1)
        next_tokens = self.tp.broadcast_ints(self._sample(logits, requests))
        return next_tokens, time.perf_counter() - start

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        temperatures = torch.tensor([r.params.temperature for r in requests], device=logits.device)
        greedy = logits.argmax(-1)
        if not temperatures.any():
            return greedy.tolist()
        probs = torch.softmax(logits.float() / temperatures.clamp(min=1e-5)[:, None], -1)
        sampled = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        return torch.where(temperatures > 0, sampled, greedy).tolist()
