"""The scheduler of continuous batching, shared by the engine and the simulator.

Every step the scheduler (1) gives each running request one decode token, preempting the most
recently admitted requests when blocks run out (swap to the CPU pool, or free and recompute later);
(2) when nothing was preempted, swaps requests back in, continues chunked prefills, and then admits
waiting ones (FIFO, no skipping), whose prefill starts after their prefix-cache hits, within
``max_num_batched_tokens``. With ``EngineConfig.chunked_prefill`` a prompt larger than what is
left of that budget is prefilled over several steps, a chunk per step; its K/V of each chunk is
written before the next chunk's queries run, which is the block manager's default
``num_computed``, so a window group frees the blocks behind each chunk's window as it goes.
All scheduled requests run as one batch: varlen prefill and decode together when someone
prefills, a pure decode batch otherwise.

The block manager's ``block_size`` decides the allocation policy: small blocks are paging; one
block of the longest request per request, without prefix caching, is contiguous max-length
reservation (``EngineConfig.contiguous``).

One request record (``Request``) serves every caller; ``StepShape`` is what a step asks of the
hardware, which the engine measures and the simulator's cost model prices.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from pagedkv import checks
from pagedkv.blocks.cascade import CascadePolicy
from pagedkv.blocks.groups import live_blocks
from pagedkv.blocks.manager import BlockManager
from pagedkv.cache.formats import CacheFormat, cache_format
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["EngineConfig", "EngineStats", "Request", "SamplingParams", "Scheduler", "Status",
           "StepShape"]


@dataclass(slots=True)
class SamplingParams:
    """``temperature`` 0 is greedy; generation stops after ``max_tokens`` or at the model's eos."""

    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.max_tokens = checks.positive(self.max_tokens, "max_tokens")
        checks.number(self.temperature, "temperature", at_least=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """A request and what happened to it. Times are seconds on the serving loop's clock."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    prefill_end: int | None = None  # during a chunked prefill: the tokens in the block manager
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the block manager once scheduled: all, or a chunked prefill's so far."""
        return self.num_tokens if self.prefill_end is None else self.prefill_end

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the end of the step that produced it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None with fewer than 2 tokens)."""
        n = len(self.output_token_ids)
        if self.finish_time is None or self.first_token_time is None or n < 2:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency per output token (the vLLM paper's metric), seconds/token."""
        if self.finish_time is None or not self.output_token_ids:
            return None
        return (self.finish_time - self.arrival_time) / len(self.output_token_ids)


@dataclass(slots=True)
class EngineConfig:
    """Cache and scheduler settings.

    ``num_blocks`` device blocks (or as many as fit in ``kv_cache_bytes``); ``num_cpu_blocks`` > 0
    preempts by swapping to a CPU pool, else (or when it is full) by freeing and recomputing.
    ``block_size`` = the longest request with prefix caching off is contiguous max-length
    reservation: one block per request (``EngineConfig.contiguous``). ``chunked_prefill``: a
    prompt over the step's remaining ``max_num_batched_tokens`` is prefilled in chunks of what
    remains (its prefix hit is looked up in its first chunk), rather than alone in a step.
    ``cache_dtype``: how the cache stores K/V (``pagedkv.cache.formats``), None for the model's
    dtype: a torch dtype (fp8: a scale per layer) or a format name such as ``"int8"``,
    ``"int4"`` or ``"fp8_e4m3_per_token_head"`` (a scale per token and head: about 2x, 4x, 2x
    the tokens of a 16-bit cache in the same ``kv_cache_bytes``). ``cascade``: attend over the
    blocks that requests share (forks, prefix-cache hits) once per group of requests, not once
    per request (``pagedkv.blocks.cascade``): None where ``CascadePolicy()`` says it pays,
    True for every group of two sharing a block, False never; a ``CascadePolicy`` of one's own.
    """

    block_size: int = 16
    num_blocks: int | None = 256
    kv_cache_bytes: int | None = None
    num_cpu_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    reserve_null_block: bool = True
    cache_dtype: torch.dtype | str | CacheFormat | None = None
    seed: int = 0
    chunked_prefill: bool = False
    cascade: bool | CascadePolicy | None = None

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
        if self.cache_dtype is not None:
            cache_format(self.cache_dtype, "cache_dtype")  # a bad name fails here, not later
        if not isinstance(self.chunked_prefill, bool):
            raise InvalidArgumentError(f"chunked_prefill must be a bool, got "
                                       f"{self.chunked_prefill!r}")
        if self.cascade is not None and not isinstance(self.cascade, (bool, CascadePolicy)):
            raise InvalidArgumentError(f"cascade must be None, a bool or a CascadePolicy, got "
                                       f"{self.cascade!r}")

    @property
    def cascade_policy(self) -> CascadePolicy | None:
        """The policy ``cascade`` names (None: no cascade)."""
        if self.cascade is None:
            return CascadePolicy()
        if isinstance(self.cascade, CascadePolicy):
            return self.cascade
        return CascadePolicy.always() if self.cascade else None

    @classmethod
    def contiguous(cls, max_len: int, num_slots: int, **kwargs) -> EngineConfig:
        """Contiguous max-length reservation over ``num_slots`` token slots: one block of
        ``max_len`` slots per request, no sharing, no null block."""
        max_len = checks.positive(max_len, "max_len")
        return cls(block_size=max_len, num_blocks=max(1, num_slots // max_len),
                   enable_prefix_caching=False, reserve_null_block=False, **kwargs)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # computed prompt tokens, recomputes included
    recompute_tokens: int = 0  # the part of prefill_tokens that recomputes preempted requests
    generated_tokens: int = 0
    peak_running: int = 0
    running_sum: int = 0  # summed over steps: requests in the batch
    swaps_out: int = 0
    swapped_blocks: int = 0  # blocks moved out and in
    recomputes: int = 0
    used_slots: int = 0  # summed over steps: slots of the blocks in use
    empty_slots: int = 0  # summed over steps: slots of running requests' blocks holding no token
    seconds: float = 0.0  # summed step times (measured by the engine, modeled by the simulator)
    cascade_steps: int = 0  # steps whose attention ran a shared-prefix cascade
    cascade_saved_tokens: int = 0  # summed over them: key rows per layer and kv head not read

    @property
    def kv_waste(self) -> float:
        """Fraction of the KV slots in use that held no token, averaged over steps."""
        return self.empty_slots / self.used_slots if self.used_slots else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step asks of the hardware.

    ``num_seqs`` sequences; ``query_tokens`` tokens computed (``prefill_tokens`` of them prompt
    or recompute tokens, the rest one decode token per sequence); ``attended`` query-key pairs
    (each query token attends every key up to its position); ``kv_read`` tokens of K/V read
    (every sequence's whole context, once per layer); ``swap_blocks`` blocks moved between device
    and CPU before the step."""

    num_seqs: int = 0
    query_tokens: int = 0
    prefill_tokens: int = 0
    attended: int = 0
    kv_read: int = 0
    swap_blocks: int = 0

    @classmethod
    def of(cls, seq_lens: list[int], query_lens: list[int], swap_blocks: int = 0) -> StepShape:
        """The shape of a batch of sequences of ``seq_lens`` tokens computing their last
        ``query_lens``."""
        attended = sum(q * n - q * (q - 1) // 2 for n, q in zip(seq_lens, query_lens, strict=True))
        return cls(num_seqs=len(seq_lens), query_tokens=sum(query_lens),
                   prefill_tokens=sum(q for q in query_lens if q > 1), attended=attended,
                   kv_read=sum(seq_lens), swap_blocks=swap_blocks)


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
        scheduled = [(request, 1) for request in self.running if request.prefill_end is None]
        if not preempted or not scheduled:  # nothing decodes: a chunked prefill may go on
            scheduled += self._swap_in()
            scheduled += self._continue_prefills(sum(q for _, q in scheduled))
            if not self.swapped:
                scheduled += self._admit(sum(q for _, q in scheduled))
        return scheduled

    def _reserve_decodes(self) -> bool:
        queue, self.running, preempted = deque(self.running), [], False
        while queue:
            request = queue.popleft()
            if request.prefill_end is not None:  # its next chunk comes after the decodes
                self.running.append(request)
                continue
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
            request.status, request.prefill_end = Status.WAITING, None
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
            if not self._can_swap_in(request):
                break
            self.swapped.popleft()
            self.manager.swap_in(request.request_id)
            self._run(request)
            if request.prefill_end is None:  # a chunked prefill continues in _continue_prefills
                self.manager.append_tokens(request.request_id, request.output_token_ids[-1])
                scheduled.append((request, 1))
        return scheduled

    def _continue_prefills(self, num_batched: int) -> list[tuple[Request, int]]:
        """The next chunk of every chunked prefill, oldest first, within the token budget;
        without room for a chunk, the newest chunked prefill not yet scheduled is preempted."""
        scheduled = []
        pending = deque(r for r in self.running if r.prefill_end is not None)
        while pending:
            request = pending.popleft()
            tokens, end = request.token_ids, request.prefill_end
            count = min(len(tokens) - end, self.config.max_num_batched_tokens - num_batched)
            if count < 1:
                break
            while not self.manager.can_append(request.request_id, count):
                victim = pending.pop() if pending else request
                self.running.remove(victim)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self.manager.append_tokens(request.request_id, tokens[end:end + count])
                request.prefill_end = None if end + count == len(tokens) else end + count
                scheduled.append((request, count))
                num_batched += count
                self._count_prefill(request, count)
        return scheduled

    def _can_swap_in(self, request: Request) -> bool:
        """Room to swap the request in (``manager.can_swap_in``, every group) and to append its
        next token (none for a chunked prefill: its chunk asks for its own room): when that
        token starts a block, one more block per group, counted against the blocks it holds
        (at least what its swap-in takes)."""
        seq_id, manager = request.request_id, self.manager
        if not manager.can_swap_in(seq_id):
            return False
        if request.prefill_end is not None or (request.num_tokens - 1) % self.config.block_size:
            return True
        groups = range(len(manager.group_windows))
        held = sum(len(live_blocks(manager.block_table(seq_id, g))) for g in groups)
        return manager.allocator.can_allocate(held + len(groups))

    def _admit(self, num_batched: int) -> list[tuple[Request, int]]:
        scheduled = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            tokens = request.token_ids
            left = self.config.max_num_batched_tokens - num_batched
            if self.config.chunked_prefill:
                if left < 1:
                    break
                tokens = tokens[:left]
            elif scheduled and len(tokens) > left:
                break
            if not self.manager.can_allocate(tokens):
                break
            self.waiting.popleft()
            cached = self.manager.add_sequence(request.request_id, tokens)
            request.num_cached_tokens = cached
            if len(tokens) < request.num_tokens:
                request.prefill_end = len(tokens)
            self._run(request)
            computed = len(tokens) - cached
            scheduled.append((request, computed))
            num_batched += computed
            self._count_prefill(request, computed)
        return scheduled

    def _count_prefill(self, request: Request, computed: int) -> None:
        self.stats.prefill_tokens += computed
        if request.output_token_ids:  # readmitted after a preemption by recompute
            self.stats.recompute_tokens += computed

    def _run(self, request: Request) -> None:
        request.status = Status.RUNNING
        self.running.append(request)

    def finish(self, request: Request) -> None:
        self.manager.free(request.request_id)
        request.status = Status.FINISHED
        self.running.remove(request)
