"""A model of PyTorch's CUDA caching allocator (one device, one stream), driven by plain numbers.

`simulate_allocator(events, config)` replays `(action, block_id, requested_bytes)` events ("alloc",
"free", "empty_cache") and returns the allocated, requested and reserved peaks, the final segments and,
given a device capacity, the first out-of-memory failure. The rules follow upstream
`c10/cuda/CUDACachingAllocator.cpp` (`malloc`, `round_size`, `get_allocation_size`, `get_free_block`,
`should_split`, `alloc_found_block`, `free_block`, `release_cached_blocks`, the expandable-segment
`find_expandable_block`/`map_block`/`unmap_block`) and `c10/core/AllocatorConfig.cpp` (option parsing):

* a request is rounded up to a multiple of 512 B (minimum 512 B), or with `roundup_power2_divisions` to
  the next 1/div step between powers of two when it is larger than 512 B * div;
* rounded sizes <= 1 MiB use the small pool, larger ones the large pool;
* best fit: the smallest free block of the pool that is large enough (ties: lowest address); with
  `max_split_size` that one candidate is refused when a request below the limit would get an oversize
  block, or when a request at or above it would waste `max_non_split_rounding` or more;
* on a miss a segment is allocated: 2 MiB for the small pool, 20 MiB for requests below 10 MiB, else the
  request rounded up to 2 MiB;
* the block takes the low end of the free block; the rest is split off when it is >= 512 B (small pool,
  or any pool with expandable segments), or when it is > 1 MiB and the request is below max_split_size
  (large pool). Otherwise the whole block is handed out and counted as allocated;
* a freed block merges with free neighbours of its segment. Segments go back to the device only on
  `empty_cache` (whole free segments; free pages of expandable segments) or on the OOM retry path
  (release oversize free segments when max_split_size is set, then everything `empty_cache` frees);
* expandable segments: one virtual segment per pool, mapped in 2 MiB (small) or 20 MiB (large) pages at
  the lowest address with room; reserved bytes are the mapped bytes.

Streams: every segment belongs to the stream current when it was allocated, and a free block is reused
only by requests on that stream (upstream keys its free blocks by stream first, `BlockComparatorSize`),
so memory a side stream frees stays reserved for it; `empty_cache` and the OOM retry release free
segments of every stream. An alloc event may name its stream (default 0).

Not modelled: `record_stream` delays (a block freed after `record_stream` waits for the other stream's
work: callers hold such blocks to where that work ends), CUDA-graph pools and MemPools, the garbage
collection threshold (parsed, ignored), `set_per_process_memory_fraction` (pass `capacity_bytes`), memory
used outside the allocator (the CUDA context and NCCL's buffers are taken from the capacity before the
replay, tracer/pipeline.py `device_setup`; cuBLAS/cuDNN handles), and the cudaMalloc addresses
themselves (new segments get synthetic addresses unless `segment_addresses` gives the real ones).
A replay stops at the first OOM, as the program would.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence

from tracer.errors import TracerError, UsageError

KIB = 1024
MIB = 1024 * KIB
MIN_BLOCK_BYTES = 512                 # kMinBlockSize
SMALL_SIZE_BYTES = 1 * MIB            # kSmallSize: largest request of the small pool
SMALL_BUFFER_BYTES = 2 * MIB          # kSmallBuffer: small-pool segment, small-pool expandable page
LARGE_BUFFER_BYTES = 20 * MIB         # kLargeBuffer: segment for requests below 10 MiB, large page
MIN_LARGE_ALLOC_BYTES = 10 * MIB      # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MIB           # kRoundLarge
POWER2_INTERVALS = 16                 # roundup_power2_divisions intervals: 1 MiB, 2 MiB, ..., 32 GiB and up
_SYNTHETIC_BASE = 1 << 44             # synthetic addresses for new segments, far from real ones
_EXPANDABLE_SPAN = 1 << 40            # virtual size of a modelled expandable segment


# ---------------------------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The caching-allocator settings that change placement (PYTORCH_CUDA_ALLOC_CONF)."""
    max_split_size_bytes: int | None = None          # None: unlimited (the default)
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: tuple[int, ...] = (0,) * POWER2_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0        # parsed for completeness; not modelled

    def divisions_for(self, nbytes: int) -> int:
        """Divisions that apply to a request of `nbytes` (interval index: log2(MiB), clamped to 0..15)."""
        index = max(0, nbytes.bit_length() - 1 - 20)
        return self.roundup_power2_divisions[min(index, POWER2_INTERVALS - 1)]


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """Parse a PYTORCH_CUDA_ALLOC_CONF string, e.g. "expandable_segments:True,max_split_size_mb:128".

    Accepts max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions (one power of two, or
    a list `[64:8,256:4,>:1]` keyed by MiB as upstream parses it), expandable_segments,
    garbage_collection_threshold, and ignores options that do not change placement (backend:native,
    release_lock_on_cudamalloc, pinned_*). Raises UsageError on anything else, naming the option.
    """
    tokens = _lex(text)
    values: dict = {}
    i = 0

    def expect(tok: str) -> None:
        nonlocal i
        if i >= len(tokens) or tokens[i] != tok:
            raise UsageError(f"allocator config {text!r}: expected {tok!r} at token {i}")
        i += 1

    def value() -> str:
        nonlocal i
        if i >= len(tokens) or tokens[i] in (",", ":", "[", "]"):
            raise UsageError(f"allocator config {text!r}: missing value at token {i}")
        i += 1
        return tokens[i - 1]

    while i < len(tokens):
        key = value()
        expect(":")
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _int(text, key, value())
            if mb < LARGE_BUFFER_BYTES // MIB:
                raise UsageError(f"allocator config {text!r}: {key} must be >= {LARGE_BUFFER_BYTES // MIB}")
            values["max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"] = \
                mb * MIB
        elif key == "roundup_power2_divisions":
            divisions = [0] * POWER2_INTERVALS
            if i < len(tokens) and tokens[i] == "[":
                i += 1
                first, last_index = True, 0
                while i < len(tokens) and tokens[i] != "]":
                    interval = value()
                    expect(":")
                    div = _int(text, key, value())
                    if div and not _is_power2(div):
                        raise UsageError(f"allocator config {text!r}: divisions must be a power of 2 or 0")
                    if interval == ">":
                        divisions[last_index:] = [div] * (POWER2_INTERVALS - last_index)
                    else:
                        mb = _int(text, key, interval)
                        if not _is_power2(mb):
                            raise UsageError(f"allocator config {text!r}: interval {mb} MiB is not a power of 2")
                        index = min(mb.bit_length() - 1, POWER2_INTERVALS - 1)
                        if first:
                            divisions[:index] = [div] * index
                            first = False
                        divisions[index] = div
                        last_index = index
                    if i < len(tokens) and tokens[i] == ",":
                        i += 1
                expect("]")
            else:
                div = _int(text, key, value())
                if not _is_power2(div):
                    raise UsageError(f"allocator config {text!r}: roundup_power2_divisions must be a power of 2")
                divisions = [div] * POWER2_INTERVALS
            values["roundup_power2_divisions"] = tuple(divisions)
        elif key == "expandable_segments":
            values["expandable_segments"] = _bool(text, key, value())
        elif key == "garbage_collection_threshold":
            raw = value()
            try:
                threshold = float(raw)
            except ValueError:
                threshold = -1.0
            if not 0.0 < threshold < 1.0:
                raise UsageError(f"allocator config {text!r}: garbage_collection_threshold must be in (0, 1)")
            values["garbage_collection_threshold"] = threshold
        elif key in ("backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                     "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                     "pinned_num_register_threads", "pinned_use_background_threads"):
            raw = value()
            if key == "backend" and raw != "native":
                raise UsageError(f"allocator config {text!r}: backend {raw!r} is not the caching allocator; "
                                 "only backend:native can be modelled")
        else:
            raise UsageError(f"allocator config {text!r}: unknown option {key!r}")
        if i < len(tokens):
            expect(",")
    return AllocatorConfig(**values)


def _lex(text: str) -> list[str]:
    tokens, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append(buf)
                buf = ""
            tokens.append(ch)
        elif ch != " ":
            buf += ch
    if buf:
        tokens.append(buf)
    return tokens


def _int(text: str, key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError as exc:
        raise UsageError(f"allocator config {text!r}: {key} needs an integer, got {raw!r}") from exc


def _bool(text: str, key: str, raw: str) -> bool:
    if raw not in ("True", "False"):
        raise UsageError(f"allocator config {text!r}: {key} must be True or False, got {raw!r}")
    return raw == "True"


def _is_power2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# ---------------------------------------------------------------------------------------------- sizes

def round_size(nbytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """Block size the allocator uses for a request of `nbytes` (upstream `round_size`)."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = config.divisions_for(nbytes)
    if divisions > 1 and nbytes > MIN_BLOCK_BYTES * divisions:
        return _roundup_power2_next_division(nbytes, divisions)
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def _roundup_power2_next_division(nbytes: int, divisions: int) -> int:
    if _is_power2(nbytes):
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return -(-nbytes // step) * step


def is_unsplit_tail(is_small: bool, gap_bytes: int) -> bool:
    """Whether a free gap right after a block belongs to the block: the large pool never keeps a free block of
    1 MiB (kSmallSize) or less (a split leaves more than 1 MiB, frees and merges only grow blocks), so such a
    gap in a large segment is the tail of a block handed out whole (`should_split` said no)."""
    return not is_small and 0 < gap_bytes <= SMALL_SIZE_BYTES


def segment_size(rounded_bytes: int) -> int:
    """cudaMalloc size on a cache miss (upstream `get_allocation_size`)."""
    if rounded_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


# ---------------------------------------------------------------------------------------------- results

@dataclasses.dataclass(frozen=True)
class SeedBlock:
    block_id: int
    address: int
    size_bytes: int
    requested_bytes: int


@dataclasses.dataclass(frozen=True)
class SeedSegment:
    """A segment that exists before the replay; `blocks` are its allocated blocks, the gaps are free."""
    address: int
    size_bytes: int
    is_small: bool
    blocks: tuple[SeedBlock, ...]


@dataclasses.dataclass(frozen=True)
class SegmentState:
    address: int
    size_bytes: int
    is_small: bool
    expandable: bool
    allocated_bytes: int
    requested_bytes: int
    block_count: int
    largest_free_bytes: int


@dataclasses.dataclass(frozen=True)
class OomReport:
    event_index: int
    block_id: int
    requested_bytes: int
    rounded_bytes: int
    device_request_bytes: int         # what the allocator asked the device for (segment or pages)
    capacity_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    device_free_bytes: int            # capacity - reserved
    cached_free_bytes: int            # reserved - allocated: free, but in pieces inside segments
    cached_free_blocks: int
    largest_cached_free_bytes: int


@dataclasses.dataclass(frozen=True)
class AllocatorReplay:
    config: AllocatorConfig
    allocated_peak_bytes: int         # sum of rounded block sizes (memory_allocated)
    requested_peak_bytes: int
    reserved_peak_bytes: int          # memory_reserved
    allocated_end_bytes: int
    requested_end_bytes: int
    reserved_end_bytes: int
    segments: tuple[SegmentState, ...]   # at the end, in address order
    device_allocs: int                # cudaMalloc calls or page-map calls
    device_frees: int                 # cudaFree calls or page-unmap calls
    alloc_addresses: tuple[int, ...]  # address handed out for each alloc event, in order
    oom: OomReport | None
    events_replayed: int

    @property
    def segment_count(self) -> int:
        return len(self.segments)

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        return tuple(s.size_bytes for s in self.segments)


class AllocatorModelError(TracerError):
    """The event stream is inconsistent (a free of a block that is not live, a reused live id)."""


# ---------------------------------------------------------------------------------------------- model

class _Block:
    __slots__ = ("address", "size", "allocated", "mapped", "prev", "next", "segment", "requested", "block_id")

    def __init__(self, address: int, size: int, segment: "_Segment", *, mapped: bool = True):
        self.address = address
        self.size = size
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment
        self.requested = 0
        self.block_id = -1


class _Segment:
    __slots__ = ("address", "is_small", "expandable", "page", "stream")

    def __init__(self, address: int, is_small: bool, expandable: bool = False, stream: int = 0):
        self.address = address
        self.is_small = is_small
        self.expandable = expandable
        self.stream = stream
        self.page = (SMALL_BUFFER_BYTES if is_small else LARGE_BUFFER_BYTES) if expandable else 0


class _Pool:
    """Free blocks ordered by (size, address); for expandable segments also unmapped blocks by address."""

    def __init__(self, is_small: bool, stream: int = 0):
        self.is_small = is_small
        self.stream = stream
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped_keys: list[int] = []
        self.unmapped: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self.keys, (block.size, block.address))
            self.blocks[block.address] = block
        else:
            bisect.insort(self.unmapped_keys, block.address)
            self.unmapped[block.address] = block

    def remove(self, block: _Block) -> None:
        if block.mapped:
            del self.keys[bisect.bisect_left(self.keys, (block.size, block.address))]
            del self.blocks[block.address]
        else:
            del self.unmapped_keys[bisect.bisect_left(self.unmapped_keys, block.address)]
            del self.unmapped[block.address]


class _Allocator:
    def __init__(self, config: AllocatorConfig, capacity: int | None, segment_addresses: Sequence[int]):
        self.config = config
        self.capacity = capacity
        self.max_split = config.max_split_size_bytes if config.max_split_size_bytes is not None else math.inf
        self.pools: dict[tuple[int, bool], _Pool] = {}     # (stream, is_small) -> its free blocks
        self.heads: dict[int, _Block] = {}       # segment address -> first block (non-expandable)
        self.expandable: dict[tuple[int, bool], _Segment] = {}
        self.live: dict[int, _Block] = {}
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.device_allocs = self.device_frees = 0
        self.segment_addresses = list(segment_addresses)
        self.next_address = _SYNTHETIC_BASE

    # -- bookkeeping
    def _peaks(self) -> None:
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def _pool(self, block: _Block) -> _Pool:
        return self._stream_pool(block.segment.stream, block.segment.is_small)

    def _stream_pool(self, stream: int, is_small: bool) -> _Pool:
        """A stream's pool: a block is only reused for requests on the stream that allocated its segment."""
        pool = self.pools.get((stream, is_small))
        if pool is None:
            pool = self.pools[stream, is_small] = _Pool(is_small, stream)
        return pool

    def _new_address(self, nbytes: int) -> int:
        if self.segment_addresses:
            return self.segment_addresses.pop(0)
        address = self.next_address
        self.next_address += -(-nbytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES + ROUND_LARGE_BYTES
        return address

    def seed(self, segments: Iterable[SeedSegment]) -> None:
        for seg in sorted(segments, key=lambda s: s.address):
            segment = _Segment(seg.address, seg.is_small)
            pieces: list[_Block] = []
            cursor, end = seg.address, seg.address + seg.size_bytes
            for sb in sorted(seg.blocks, key=lambda b: b.address):
                if sb.address < cursor or sb.address + sb.size_bytes > end:
                    raise AllocatorModelError(f"seed block {sb.block_id} at {sb.address:#x} overlaps another "
                                              f"block or leaves segment {seg.address:#x}")
                if sb.address > cursor:
                    pieces.append(_Block(cursor, sb.address - cursor, segment))
                block = _Block(sb.address, sb.size_bytes, segment)
                block.allocated, block.requested, block.block_id = True, sb.requested_bytes, sb.block_id
                pieces.append(block)
                self.live[sb.block_id] = block
                self.allocated += sb.size_bytes
                self.requested += sb.requested_bytes
                cursor = sb.address + sb.size_bytes
            if cursor < end:
                pieces.append(_Block(cursor, end - cursor, segment))
            for a, b in zip(pieces, pieces[1:]):
                a.next, b.prev = b, a
            for piece in pieces:
                if not piece.allocated:
                    self._pool(piece).add(piece)
            self.heads[seg.address] = pieces[0]
            self.reserved += seg.size_bytes
            self.next_address = max(self.next_address, end + ROUND_LARGE_BYTES)
        self._peaks()

    # -- malloc
    def malloc(self, requested: int, stream: int = 0) -> _Block | None:
        size = round_size(requested, self.config)
        pool = self._stream_pool(stream, size <= SMALL_SIZE_BYTES)
        alloc_size = segment_size(size)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size)
            if block is None:
                self.empty_cache()
                block = self._alloc_block(pool, size, alloc_size)
            if block is None:
                return None
        return self._alloc_found_block(pool, block, size, requested)

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i][1]]
        if block.segment.expandable:
            def reach(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(pool.keys):
                nxt = pool.blocks[pool.keys[i + 1][1]]
                if not (block.segment.expandable and reach(nxt) < reach(block)):
                    break
                i, block = i + 1, nxt
        if size < self.max_split <= block.size:
            return None
        if size >= self.max_split and block.size >= size + self.config.max_non_split_rounding_bytes:
            return None
        pool.remove(block)
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        if self.config.expandable_segments:
            return self._alloc_expandable(pool, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        segment = _Segment(self._new_address(alloc_size), pool.is_small, stream=pool.stream)
        block = _Block(segment.address, alloc_size, segment)
        self.heads[segment.address] = block
        self.reserved += alloc_size
        self.device_allocs += 1
        self._peaks()
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.segment.is_small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return size < self.max_split and remaining > SMALL_SIZE_BYTES

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int, requested: int) -> _Block:
        if self._should_split(block, size):
            rest = _Block(block.address + size, block.size - size, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated, block.requested = True, requested
        self.allocated += block.size
        self.requested += requested
        self._peaks()
        return block

    # -- free
    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        self.requested -= block.requested
        block.allocated, block.requested, block.block_id = False, 0, -1
        pool = self._pool(block)
        for other in (block.prev, block.next):
            self._merge(pool, block, other)
        pool.add(block)

    def _merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool.remove(src)
        if dst.prev is src:
            dst.address, dst.prev = src.address, src.prev
            if src.prev is not None:
                src.prev.next = dst
            elif not dst.segment.expandable:
                self.heads[dst.address] = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # -- releasing segments
    def _release_segment(self, block: _Block) -> None:
        self._pool(block).remove(block)
        del self.heads[block.address]
        self.reserved -= block.size
        self.device_frees += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        if self.max_split == math.inf:
            return False
        key = max(size, self.max_split)
        i = bisect.bisect_left(pool.keys, (key, -1))
        if i < len(pool.keys) and not pool.blocks[pool.keys[i][1]].segment.expandable:
            self._release_segment(pool.blocks[pool.keys[i][1]])
            return True
        released = 0
        j = i - 1                     # largest blocks first
        while j >= 0 and released < key:
            block = pool.blocks[pool.keys[j][1]]
            if block.size < self.max_split:
                break
            if not block.segment.expandable and block.prev is None and block.next is None:
                released += block.size
                self._release_segment(block)
            j -= 1
        return released >= key

    def empty_cache(self) -> None:
        for pool in list(self.pools.values()):
            for address in [a for _, a in pool.keys]:
                block = pool.blocks[address]
                if block.segment.expandable:
                    self._unmap(pool, block)
                elif block.prev is None and block.next is None:
                    self._release_segment(block)

    # -- expandable segments
    def _alloc_expandable(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            candidate = self._map(pool, candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:
            nxt = candidate.next
            mapped = self._map(pool, nxt, min(size - candidate.size, nxt.size))
            if mapped is None:
                return None
            candidate = mapped
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for address in pool.unmapped_keys:
            c = pool.unmapped[address]
            if allocatable(c.prev):
                c = c.prev
            room, b = 0, c
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        segment = _Segment(_SYNTHETIC_BASE * (2 if pool.is_small else 3) + len(self.expandable) * _EXPANDABLE_SPAN,
                           pool.is_small, expandable=True, stream=pool.stream)
        self.expandable[pool.stream, pool.is_small] = segment
        block = _Block(segment.address, _EXPANDABLE_SPAN, segment, mapped=False)
        pool.add(block)
        return block

    def _map(self, pool: _Pool, block: _Block, nbytes: int) -> _Block | None:
        page = block.segment.page
        mapped = -(-nbytes // page) * page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return None
        pool.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, block.segment, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            pool.add(rest)
        for other in (block.prev, block.next):
            self._merge(pool, block, other)
        pool.add(block)
        self.reserved += mapped
        self.device_allocs += 1
        self._peaks()
        return block

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        page, base = block.segment.page, block.segment.address
        first = base + -(-(block.address - base) // page) * page
        last = base + (block.address + block.size - base) // page * page
        if first >= last:
            return
        pool.remove(block)
        if first > block.address:
            before = _Block(block.address, first - block.address, block.segment)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.add(before)
        if last < block.address + block.size:
            after = _Block(last, block.address + block.size - last, block.segment)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.add(after)
        block.address, block.size, block.mapped = first, last - first, False
        for other in (block.prev, block.next):
            self._merge(pool, block, other)
        pool.add(block)
        self.reserved -= last - first
        self.device_frees += 1

    # -- reporting
    def segments(self) -> tuple[SegmentState, ...]:
        out = [self._state(head, False) for head in self.heads.values()]
        for segment in self.expandable.values():
            head = self._first_block(segment)
            run: list[_Block] = []
            b: _Block | None = head
            while b is not None:
                if b.mapped:
                    run.append(b)
                elif run:
                    out.append(self._run_state(run))
                    run = []
                b = b.next
            if run:
                out.append(self._run_state(run))
        return tuple(sorted(out, key=lambda s: s.address))

    def _first_block(self, segment: _Segment) -> _Block:
        pool = self._stream_pool(segment.stream, segment.is_small)
        some = next((b for b in self.live.values() if b.segment is segment), None) or next(
            (b for b in (*pool.blocks.values(), *pool.unmapped.values()) if b.segment is segment))
        while some.prev is not None:
            some = some.prev
        return some

    def _state(self, head: _Block, expandable: bool) -> SegmentState:
        run = []
        b: _Block | None = head
        while b is not None:
            run.append(b)
            b = b.next
        return self._run_state(run, expandable)

    @staticmethod
    def _run_state(run: list[_Block], expandable: bool = True) -> SegmentState:
        free = [b.size for b in run if not b.allocated]
        return SegmentState(
            address=run[0].address, size_bytes=sum(b.size for b in run), is_small=run[0].segment.is_small,
            expandable=expandable, allocated_bytes=sum(b.size for b in run if b.allocated),
            requested_bytes=sum(b.requested for b in run if b.allocated), block_count=len(run),
            largest_free_bytes=max(free, default=0))

    def oom_report(self, index: int, block_id: int, requested: int) -> OomReport:
        size = round_size(requested, self.config)
        asked = segment_size(size)
        if self.config.expandable_segments:
            page = SMALL_BUFFER_BYTES if size <= SMALL_SIZE_BYTES else LARGE_BUFFER_BYTES
            asked = -(-size // page) * page
        free = [b.size for pool in self.pools.values() for b in pool.blocks.values()]
        return OomReport(
            event_index=index, block_id=block_id, requested_bytes=requested, rounded_bytes=size,
            device_request_bytes=asked, capacity_bytes=self.capacity or 0, reserved_bytes=self.reserved,
            allocated_bytes=self.allocated, device_free_bytes=(self.capacity or 0) - self.reserved,
            cached_free_bytes=self.reserved - self.allocated, cached_free_blocks=len(free),
            largest_cached_free_bytes=max(free, default=0))


def simulate_allocator(events: Iterable[tuple[str, int, int]], config: AllocatorConfig = AllocatorConfig(), *,
                       capacity_bytes: int | None = None, seed: Iterable[SeedSegment] = (),
                       segment_addresses: Sequence[int] = ()) -> AllocatorReplay:
    """Replay allocator requests and return peaks, final segments and the first OOM (if any).

    events: ("alloc", block_id, requested_bytes[, stream]), ("free", block_id, _), ("empty_cache", _, _);
        `stream` (an int, 0 = the default stream) is the stream current at the allocation: the block's
        segment belongs to it, and its free blocks serve only that stream's later requests.
    capacity_bytes: device memory the allocator may reserve; a request that cannot be met even after
        releasing cached segments is an OOM, reported with the free memory left in pieces, and ends the
        replay. None: unlimited.
    seed: segments (with their allocated blocks) that exist before the first event; their block ids can
        be freed by the events. Seeded segments are never expandable.
    segment_addresses: addresses for the segments the replay allocates, in order (for comparing with a
        real trace); synthetic addresses are used after they run out.

    Raises:
        AllocatorModelError: a free of a block id that is not live, an alloc of a live id, an unknown
            action, or a seed block outside its segment.
    """
    model = _Allocator(config, capacity_bytes, segment_addresses)
    model.seed(seed)
    addresses: list[int] = []
    oom = None
    count = 0
    for index, (action, block_id, nbytes, *on) in enumerate(events):
        if action == "alloc":
            if block_id in model.live:
                raise AllocatorModelError(f"event {index}: alloc of block {block_id}, which is already live")
            block = model.malloc(int(nbytes), int(on[0]) if on else 0)
            if block is None:
                oom = model.oom_report(index, block_id, int(nbytes))
                break
            block.block_id = block_id
            model.live[block_id] = block
            addresses.append(block.address)
        elif action == "free":
            block = model.live.pop(block_id, None)
            if block is None:
                raise AllocatorModelError(f"event {index}: free of block {block_id}, which is not live")
            model.free(block)
        elif action == "empty_cache":
            model.empty_cache()
        else:
            raise AllocatorModelError(f"event {index}: unknown action {action!r}; use alloc, free or empty_cache")
        count = index + 1
    return AllocatorReplay(
        config=config, allocated_peak_bytes=model.peak_allocated, requested_peak_bytes=model.peak_requested,
        reserved_peak_bytes=model.peak_reserved, allocated_end_bytes=model.allocated,
        requested_end_bytes=model.requested, reserved_end_bytes=model.reserved, segments=model.segments(),
        device_allocs=model.device_allocs, device_frees=model.device_frees, alloc_addresses=tuple(addresses),
        oom=oom, events_replayed=count)
