"""A small inference engine over the paged KV cache: requests, continuous batching, preemption.

Every step the scheduler (1) gives each running request one decode token, preempting the most
recently admitted requests when blocks run out (swap to the CPU pool, or free and recompute later);
(2) when nothing was preempted, swaps requests back in and then admits waiting ones, whose prefill
starts after their prefix-cache hits. All scheduled requests run as one batch: varlen prefill and
decode together when someone prefills, a pure decode batch otherwise.

Bad requests are refused at ``add_request`` (``generate`` checks its whole batch before queueing
any of it), so one client's token ids cannot stop the others. A step that raises (a failing
kernel, say) keeps its scheduled batch in flight: the next ``step()`` applies the rest of the
cache plan and runs the same batch, so nothing is lost or generated twice. Like the block manager,
the engine is driven by one thread.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from pagedkv import checks
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor, cpu_cache_for
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError
from pagedkv.serving.model import LlamaForCausalLM

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "Request", "SamplingParams", "Status"]


@dataclass(slots=True)
class SamplingParams:
    """``temperature`` 0 is greedy; generation stops after ``max_tokens`` or at the model's eos."""

    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.max_tokens = checks.positive(self.max_tokens, "max_tokens")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature >= 0):
            raise InvalidArgumentError(
                f"temperature must be a finite number >= 0, got {temperature!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(slots=True)
class EngineConfig:
    """Cache and scheduler settings.

    ``num_blocks`` device blocks (or as many as fit in ``kv_cache_bytes``); ``num_cpu_blocks`` > 0
    preempts by swapping to a CPU pool, else (or when it is full) by freeing and recomputing.
    ``block_size`` = the longest request with prefix caching off is contiguous max-length
    reservation: one block per request.
    """

    block_size: int = 16
    num_blocks: int | None = 256
    kv_cache_bytes: int | None = None
    num_cpu_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    reserve_null_block: bool = True
    cache_dtype: torch.dtype | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.block_size = checks.positive(self.block_size, "block_size")
        if self.num_blocks is None and self.kv_cache_bytes is None:
            raise InvalidArgumentError("EngineConfig needs num_blocks or kv_cache_bytes")
        if self.num_blocks is not None:
            self.num_blocks = checks.positive(self.num_blocks, "num_blocks")
        if self.kv_cache_bytes is not None:
            self.kv_cache_bytes = checks.positive(self.kv_cache_bytes, "kv_cache_bytes")
        self.num_cpu_blocks = checks.count(self.num_cpu_blocks, "num_cpu_blocks")
        self.max_num_seqs = checks.positive(self.max_num_seqs, "max_num_seqs")
        self.max_num_batched_tokens = checks.positive(self.max_num_batched_tokens,
                                                      "max_num_batched_tokens")
        self.seed = checks.count(self.seed, "seed")


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    peak_running: int = 0
    swaps_out: int = 0
    recomputes: int = 0
    used_slots: int = 0  # summed over steps: slots of the blocks in use
    empty_slots: int = 0  # summed over steps: slots of running requests' blocks holding no token
    seconds: float = 0.0

    @property
    def kv_waste(self) -> float:
        """Fraction of the KV slots in use that held no token, averaged over steps."""
        return self.empty_slots / self.used_slots if self.used_slots else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class Scheduler:
    """Decides each step's requests and query lengths; owns the request queues."""

    def __init__(self, config: EngineConfig, manager: BlockManager, stats: EngineStats) -> None:
        self.config, self.manager, self.stats = config, manager, stats
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, query tokens) for this step, their tokens already in the block manager."""
        preempted = self._reserve_decodes()
        scheduled = [(request, 1) for request in self.running]
        if not preempted or not self.running:
            scheduled += self._swap_in()
            if not self.swapped:
                scheduled += self._admit(sum(q for _, q in scheduled))
        return scheduled

    def _reserve_decodes(self) -> bool:
        queue, self.running, preempted = deque(self.running), [], False
        while queue:
            request = queue.popleft()
            while not self.manager.can_append(request.request_id):
                preempted = True
                victim = queue.pop() if queue else request
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self.manager.append_tokens(request.request_id, request.output_token_ids[-1])
                self.running.append(request)
        return preempted

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        try:
            self.manager.swap_out(request.request_id)
        except OutOfBlocksError:
            self.manager.free(request.request_id)
            request.status = Status.WAITING
            self.waiting.appendleft(request)
            self.stats.recomputes += 1
            return
        request.status = Status.SWAPPED
        self.swapped.append(request)
        self.stats.swaps_out += 1

    def _swap_in(self) -> list[tuple[Request, int]]:
        scheduled = []
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            blocks = len(self.manager.block_table(request.request_id))
            if not self.manager.allocator.can_allocate(blocks + 1):
                break
            self.swapped.popleft()
            self.manager.swap_in(request.request_id)
            self.manager.append_tokens(request.request_id, request.output_token_ids[-1])
            self._run(request)
            scheduled.append((request, 1))
        return scheduled

    def _admit(self, num_batched: int) -> list[tuple[Request, int]]:
        scheduled = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            tokens = request.token_ids
            over_budget = num_batched + len(tokens) > self.config.max_num_batched_tokens
            if (scheduled and over_budget) or not self.manager.can_allocate(tokens):
                break
            self.waiting.popleft()
            cached = self.manager.add_sequence(request.request_id, tokens)
            request.num_cached_tokens = cached
            self._run(request)
            scheduled.append((request, len(tokens) - cached))
            num_batched += len(tokens) - cached
            self.stats.prefill_tokens += len(tokens) - cached
        return scheduled

    def _run(self, request: Request) -> None:
        request.status = Status.RUNNING
        self.running.append(request)

    def finish(self, request: Request) -> None:
        self.manager.free(request.request_id)
        request.status = Status.FINISHED
        self.running.remove(request)


class LLMEngine:
    """Generates for many requests at once with ``model`` over a paged KV cache.

    Example
    -------
    >>> engine = LLMEngine(LlamaForCausalLM.from_hf(hf_model), EngineConfig(num_blocks=128))
    >>> outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    """

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig | None = None) -> None:
        self.model, self.config = model.eval(), config or EngineConfig()
        param = next(model.parameters())
        self.device = param.device
        spec = model.config.kv_cache_spec(self.config.block_size, param.dtype,
                                          self.config.cache_dtype)
        num_blocks = self.config.num_blocks
        if self.config.kv_cache_bytes is not None:
            num_blocks = spec.num_blocks_for(self.config.kv_cache_bytes)
        if num_blocks < 1 + self.config.reserve_null_block:
            raise InvalidArgumentError(f"a KV budget of {num_blocks} block(s) of "
                                       f"{spec.bytes_per_block} bytes holds no request")
        self.cache = PagedKVCache(spec, num_blocks, self.device)
        num_cpu_blocks = self.config.num_cpu_blocks
        self.cpu_cache = cpu_cache_for(self.cache, num_cpu_blocks) if num_cpu_blocks else None
        self.manager = BlockManager(num_blocks, self.config.block_size,
                                    num_cpu_blocks=num_cpu_blocks,
                                    enable_prefix_caching=self.config.enable_prefix_caching,
                                    reserve_null_block=self.config.reserve_null_block)
        self.executor = PlanExecutor(self.cache, self.cpu_cache)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.config, self.manager, self.stats)
        self.generator = torch.Generator(self.device).manual_seed(self.config.seed)
        self._ids = itertools.count()
        self._in_flight: list[tuple[Request, int]] | None = None

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) the device pool can hold."""
        return self.manager.allocator.num_usable_blocks * self.config.block_size

    @property
    def prefix_hit_rate(self) -> float:
        prefix = self.manager.prefix_cache
        return prefix.stats.hit_rate if prefix is not None else 0.0

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; it joins the running batch at a coming step.

        Raises InvalidArgumentError, queueing nothing, for a prompt that is empty, not integer
        token ids, holds an id outside the model's vocabulary, or with ``params.max_tokens`` does
        not fit the cache or the model's positions."""
        prompt, params = self._check_request(prompt, params)
        return self._queue(prompt, params)

    def _check_request(self, prompt: Sequence[int], params: SamplingParams | None,
                       name: str = "prompt") -> tuple[list[int], SamplingParams]:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {params!r}")
        prompt = checks.token_ids(prompt, name, self.model.config.vocab_size)
        if not prompt:
            raise InvalidArgumentError(f"{name} is empty; a request needs at least one token")
        total = len(prompt) + params.max_tokens
        limit = min(self.max_request_tokens, self.model.config.max_position_embeddings)
        if total > limit:
            raise InvalidArgumentError(
                f"{name}: a request of {len(prompt)} + {params.max_tokens} tokens exceeds the "
                f"cache ({self.max_request_tokens} tokens) or the model's positions "
                f"({self.model.config.max_position_embeddings})")
        return prompt, params

    def _queue(self, prompt: list[int], params: SamplingParams) -> Request:
        request = Request(next(self._ids), prompt, params)
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
        batch = self.manager.build_batch([r.request_id for r in requests], query_lens,
                                         device=self.device)
        tokens = [r.token_ids for r in requests]
        input_ids = [t for seq, q in zip(tokens, query_lens, strict=True) for t in seq[-q:]]
        positions = [p for seq, q in zip(tokens, query_lens, strict=True)
                     for p in range(len(seq) - q, len(seq))]
        self.executor.run(self.manager)
        with torch.inference_mode():
            logits = self.model(torch.tensor(input_ids, device=self.device),
                                torch.tensor(positions, device=self.device), self.cache, batch,
                                batch.query_start_loc[1:].long() - 1)
        next_tokens = self._sample(logits, requests)
        self._in_flight = None
        self._record(requests)
        finished = [r for r, t in zip(requests, next_tokens, strict=True) if self._append(r, t)]
        for request in finished:
            self.scheduler.finish(request)
        self.stats.seconds += time.perf_counter() - start
        return finished

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        temperatures = torch.tensor([r.params.temperature for r in requests], device=logits.device)
        greedy = logits.argmax(-1)
        if not temperatures.any():
            return greedy.tolist()
        probs = torch.softmax(logits.float() / temperatures.clamp(min=1e-5)[:, None], -1)
        sampled = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        return torch.where(temperatures > 0, sampled, greedy).tolist()

    def _append(self, request: Request, token: int) -> bool:
        request.output_token_ids.append(token)
        self.stats.generated_tokens += 1
        eos = self.model.config.eos_token_id
        hit_eos = token == eos and not request.params.ignore_eos
        return hit_eos or len(request.output_token_ids) >= request.params.max_tokens

    def _record(self, requests: list[Request]) -> None:
        stats, size = self.stats, self.config.block_size
        stats.steps += 1
        stats.peak_running = max(stats.peak_running, len(requests))
        stats.used_slots += self.manager.allocator.num_used_blocks * size
        stats.empty_slots += sum(len(self.manager.block_table(r.request_id)) * size
                                 - len(r.token_ids) for r in requests)

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
        requests = [self._queue(p, s) for p, s in checked]
        while self.has_unfinished():
            self.step()
        return [r.output_token_ids for r in requests]
