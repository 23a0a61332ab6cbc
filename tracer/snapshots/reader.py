"""Read a CUDA memory snapshot pickle (`torch.cuda.memory._dump_snapshot()`) into plain frozen numbers.

Contract
--------
* `load_snapshot_dict(path)` unpickles with a restricted unpickler that refuses every global, so only
  dicts, lists, tuples, strings, bytes, numbers, booleans and None load. A snapshot is untrusted input: a
  pickle that names any callable (`os.system`, `builtins.eval`, even `builtins.set`) raises
  `SnapshotError` before anything runs. A bare list is read as the legacy `memory_snapshot()` segment list.
* `summarize_snapshot(data)` is a pure function of that dict; `read_snapshot(path)` is the two together.
* Live bytes are *requested* bytes (trace `alloc`/`free_*` sizes, block `requested_size`), as in the
  viewer (MemoryViz.js). The timeline has one entry per raw trace entry of the chosen device: live bytes
  after that entry. `peak_index` indexes `device_traces[device]`; -1 means the peak is the state before
  the trace (or there is no trace).
* Frees: `free_requested` immediately followed by its `free_completed` is one free (the viewer's merge).
  By default a block stops counting at `free_completed` (when the allocator can reuse it; a
  `record_stream` delay keeps it live in between); `free_at="free_requested"` counts it freed when the
  program dropped it. A `free_completed` without a `free_requested` (dropped by `skip_actions`) frees.
* Blocks allocated before recording started are recovered as the viewer does: a free of an address that
  the trace never allocated (size = the entry's size), and every `active_allocated` block of `segments`
  (and `active_pending_free` when counting at `free_completed`) not live at the end of the trace replay
  (size = `requested_size`). Their sum is `before_bytes`.
* Reserved bytes: anchored at the final sum of segment `total_size` on the device and replayed backwards
  through `segment_alloc`/`segment_free`/`segment_map`/`segment_unmap`.
* Phases come from each allocation's own stack (`classify_frames`): the autograd engine or a `backward`
  frame means backward; `torch/optim` means optimizer; a module `forward` is forward; a user function
  named `step`, `zero_grad` or `*optimizer*` with no module frame inside it means optimizer; anything
  else is forward. An allocation without frames, in a snapshot whose other allocations have frames, comes
  from a thread with no Python stack (the autograd engine's device thread under `stacks="python"`), so
  it is backward. Frees and other entries take the phase of the latest allocation. With no frames at all
  the phase is unknown (None).
* Attribution: each live block goes to its innermost user frame (`is_user_frame`: a Python frame outside
  torch, the standard library and site-packages). Blocks with no user frame (backward allocations only
  have C++ frames) are grouped under `<no user frame>` and the autograd node that allocated them, or
  `allocated before the trace` (a pre-trace block found by its free only has the stack of the free).

Not handled: several devices at once (pick one with `device=`), annotations (`external_annotations`) as
phase markers, `_profile_to_snapshot` categories, and CUDA-graph private pools (their segments are
summed like any other). Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import pickletools
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tracer.errors import ExitCode, TracerError
from tracer.stepgraph import Phase, SourceLoc

FREE_ACTIONS = ("free_completed", "free_requested")
NO_USER_FRAME = "<no user frame>"
BEFORE_TRACE = "allocated before the trace"
AUTOGRAD_ENGINE = "autograd engine"
_KNOWN_ACTIONS = frozenset({"alloc", "free", "free_requested", "free_completed", "segment_alloc", "segment_free",
                            "segment_map", "segment_unmap", "snapshot", "oom"})
_RESERVED_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh")
_STDLIB = re.compile(r"/lib/python\d+(\.\d+)?/")          # also covers site-packages / dist-packages
_BACKWARD_CPP = ("torch::autograd::Engine::", "torch::autograd::python::PythonEngine::",
                 "torch::autograd::generated::", "torch::autograd::AccumulateGrad")
_AUTOGRAD_NODE = re.compile(r"torch::autograd::generated::(\w+)::apply|torch::autograd::(AccumulateGrad)::apply")


class SnapshotError(TracerError):
    """The snapshot file cannot be read: missing, not a pickle, refers to code, or not a snapshot."""
    exit_code = ExitCode.USAGE


# ---------------------------------------------------------------------------------------------- results

@dataclasses.dataclass(frozen=True)
class LiveBlock:
    address: int
    requested_bytes: int
    alloc_index: int                  # trace index of its alloc; -1 when allocated before the trace
    phase: str | None                 # phase of its alloc; None before the trace
    source: SourceLoc | None          # innermost user frame
    label: str                        # no user frame: autograd node, BEFORE_TRACE, AUTOGRAD_ENGINE or ""


@dataclasses.dataclass(frozen=True)
class LineBytes:
    file: str                         # NO_USER_FRAME when no user frame exists
    line: int
    function: str                     # for NO_USER_FRAME: the LiveBlock label
    bytes_at_peak: int
    blocks: int


@dataclasses.dataclass(frozen=True)
class SegmentSummary:
    """The final `segments` of the device."""
    count: int
    reserved_bytes: int               # sum of total_size
    allocated_bytes: int              # sum of block sizes of active_allocated blocks (rounded)
    requested_bytes: int              # sum of requested sizes of active_allocated blocks
    free_bytes: int                   # sum of inactive block sizes (cached, reusable)
    largest_free_block_bytes: int
    small_count: int
    small_bytes: int
    large_count: int
    large_bytes: int
    expandable_count: int
    sizes: tuple[int, ...]            # total_size of each segment, in address order


@dataclasses.dataclass(frozen=True)
class OomEvent:
    index: int
    requested_bytes: int
    device_free_bytes: int


@dataclasses.dataclass(frozen=True)
class SnapshotReading:
    source: str
    device: int
    free_at: str
    peak_bytes: int
    peak_index: int
    peak_phase: str | None
    phases: dict[str, int]            # phase -> peak live bytes over the allocations of that phase
    before_bytes: int
    end_bytes: int
    end_bytes_from_segments: int      # requested bytes of active blocks in `segments` (consistency check)
    reserved_start_bytes: int
    reserved_peak_bytes: int
    reserved_end_bytes: int
    top_lines: tuple[LineBytes, ...]
    live_at_peak: tuple[LiveBlock, ...]
    timeline: tuple[int, ...]         # live bytes after each trace entry
    reserved_timeline: tuple[int, ...]
    phase_spans: tuple[tuple[str | None, int, int], ...]   # (phase, first index, last index), in order
    segments: SegmentSummary
    ooms: tuple[OomEvent, ...]
    snapshot_indices: tuple[int, ...]
    pre_trace_blocks: int
    delayed_frees: int                # free_requested not immediately followed by its free_completed
    ignored_actions: tuple[str, ...]  # unknown trace actions (newer formats), skipped


@dataclasses.dataclass(frozen=True)
class InitialBlock:
    block_id: int
    address: int
    size_bytes: int                   # rounded block size
    requested_bytes: int


@dataclasses.dataclass(frozen=True)
class InitialSegment:
    address: int
    size_bytes: int
    is_small: bool
    blocks: tuple[InitialBlock, ...]  # allocated blocks only; the gaps are free


@dataclasses.dataclass(frozen=True)
class ReplayInputs:
    """A snapshot's own request stream, for replaying through an allocator model (plain numbers)."""
    segments: tuple[InitialSegment, ...]         # segments and live blocks when recording started
    events: tuple[tuple[str, int, int], ...]     # ("alloc" | "free", block_id, requested bytes)
    alloc_addresses: tuple[int, ...]             # real address of each alloc event, in order
    segment_addresses: tuple[int, ...]           # addresses of segments allocated during the trace
    ambiguous_blocks: int                        # pre-trace blocks whose unsplit tail could not be decided


# ---------------------------------------------------------------------------------------------- loading

class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise _ForbiddenGlobal(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _ForbiddenGlobal(f"persistent id {pid!r}")


class _ForbiddenGlobal(Exception):
    pass


def load_snapshot_dict(path: str | Path) -> dict:
    """Unpickle a snapshot, accepting plain data only.

    Raises:
        SnapshotError: the file is missing or unreadable, is not a pickle, refers to any global (code), or
            does not hold a dict (or a legacy list of segments).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            if file_bytes > MAX_SNAPSHOT_BYTES:
                raise SnapshotError(f"{path}: {file_bytes:,} bytes is over the reader's limit of "
                                    f"{MAX_SNAPSHOT_BYTES:,} bytes", hint="record fewer steps or a shorter trace")
            head = f.read(2)
            if len(head) < 2 or head[:1] not in _PICKLE_OPCODES:
                raise SnapshotError(f"{path}: not a readable pickle (it starts with {head!r}); "
                                    "torch.cuda.memory._dump_snapshot() writes one")
            f.seek(0)
            data = _load_plain_data(f, path)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read the snapshot ({exc.strerror or exc})") from exc
    if isinstance(data, list):
        data = {"segments": data}
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: not a CUDA memory snapshot (top level is {type(data).__name__}, "
                            "expected the dict written by torch.cuda.memory._dump_snapshot())")
    check_snapshot_structure(data, source=str(path), file_bytes=file_bytes)
    return data


def _load_plain_data(f, path: Path):
    try:
        return _PlainDataUnpickler(f).load()
    except _ForbiddenGlobal as exc:
        raise SnapshotError(
            f"{path}: refused to load: the pickle refers to {exc}. A snapshot is untrusted input and only "
            "plain data (dicts, lists, strings, numbers) is accepted",
            hint="regenerate it with torch.cuda.memory._dump_snapshot()") from exc
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not a snapshot"; chained below
        raise SnapshotError(f"{path}: not a readable pickle ({type(exc).__name__}: {_short(exc)})") from exc


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def check_snapshot_structure(data: dict, *, source: str = "<snapshot>", file_bytes: int | None = None) -> None:
    """Refuse (SnapshotError, one line) a dict that is not a snapshot the reader can read: no `segments` and
    no `device_traces`; a value of the wrong type where the reader looks (a size that is not an integer,
    negative, or over 2**64; frames that are not a list of frame dicts; a device that is not an integer);
    or, with `file_bytes`, more entries than `EXPANSION_PER_BYTE` per byte of the file (plus
    `EXPANSION_FLOOR`) once shared references are counted as often as they are reached: the work of
    reading it is bounded by the file's size. Walks only the keys the reader uses, level by level, counting
    each list's length before it walks it, and keeps nothing per entry; distinct frame lists are checked
    once each."""
    if "segments" not in data and "device_traces" not in data:
        keys = ", ".join(repr(k) for k in list(data)[:5]) or "none"
        raise SnapshotError(f"{source}: not a CUDA memory snapshot (no segments and no device_traces; keys: {keys})",
                            hint="write it with torch.cuda.memory._dump_snapshot()")
    budget = None if file_bytes is None else EXPANSION_FLOOR + EXPANSION_PER_BYTE * file_bytes
    walk = _StructureCheck(source, budget)
    segments = walk.seq(data.get("segments"), "segments")
    traces = walk.seq(data.get("device_traces"), "device_traces")
    traces = [walk.seq(t, f"device_traces[{d}]") for d, t in enumerate(traces)]
    walk.spend(len(segments) + sum(len(t) for t in traces))
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        walk.mapping(seg, where)
        for key in ("address", "total_size"):
            walk.count(seg.get(key), f"{where}.{key}")
        device = seg.get("device")
        if device is not None and not _is_count(device, limit=1 << 16):
            raise SnapshotError(f"{source}: {where}.device is {_show(device)}, not a device index")
        if not isinstance(seg.get("segment_type", ""), (str, type(None))):
            raise SnapshotError(f"{source}: {where}.segment_type is {_show(seg.get('segment_type'))}, not text")
        seg_blocks = walk.seq(seg.get("blocks"), f"{where}.blocks")
        walk.spend(len(seg_blocks))
        for j, blk in enumerate(seg_blocks):     # checked as they are reached: nothing is kept per entry
            _check_block(walk, blk, f"{where}.blocks[{j}]")
    for d, trace in enumerate(traces):
        for k, entry in enumerate(trace):
            where = f"device_traces[{d}][{k}]"
            walk.mapping(entry, where)
            if not isinstance(entry.get("action"), str):
                raise SnapshotError(f"{source}: {where}.action is {_show(entry.get('action'))}, not text")
            for key in ("addr", "size"):
                walk.count(entry.get(key), f"{where}.{key}")
            walk.frames(entry.get("frames"), f"{where}.frames")


def _check_block(walk: "_StructureCheck", blk, where: str) -> None:
    walk.mapping(blk, where)
    walk.count(blk.get("size"), f"{where}.size", required=True)
    for key in ("address", "requested_size"):
        walk.count(blk.get(key), f"{where}.{key}")
    if not isinstance(blk.get("state", ""), str):
        walk.fail(f"{where}.state is {_show(blk.get('state'))}, not text")
    walk.frames(blk.get("frames"), f"{where}.frames")
    history = walk.seq(blk.get("history"), f"{where}.history")
    walk.spend(len(history))
    for k, event in enumerate(history):
        walk.mapping(event, f"{where}.history[{k}]")
        walk.count(event.get("real_size"), f"{where}.history[{k}].real_size")
        walk.frames(event.get("frames"), f"{where}.history[{k}].frames")


_PICKLE_OPCODES = frozenset(op.code.encode("latin-1") for op in pickletools.opcodes)
# Larger files are refused before anything is read: unpickled, a snapshot takes several times its bytes in
# Python objects, and 1 GiB holds millions of trace entries, more than a training step's recording.
MAX_SNAPSHOT_BYTES = 1 << 30
# Entries reached (shared references counted each time they are reached) per byte of the file: real
# snapshots reach about 0.2 per byte (two CUDA snapshots of a training step, 3.1 and 3.9 MB: 0.21, 0.20), so 2 is
# ten times what they need, and bounds the reader's work by the file's size.
EXPANSION_PER_BYTE = 2
EXPANSION_FLOOR = 1 << 20
_MAX_COUNT = 1 << 64                  # addresses and sizes are 64-bit


def _is_count(value, *, limit: int = _MAX_COUNT) -> bool:
    return type(value) is int and 0 <= value < limit


def _show(value) -> str:
    if isinstance(value, (dict, list, tuple)):
        return f"a {type(value).__name__}"
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 128 else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


class _StructureCheck:
    def __init__(self, source: str, budget: int | None):
        self.source, self.budget, self.reached = source, budget, 0
        self._frames_seen: set[int] = set()
        self._keep: list = []                      # keeps checked frame lists alive, so their ids stay unique

    def fail(self, message: str):
        raise SnapshotError(f"{self.source}: {message}", hint="write it with torch.cuda.memory._dump_snapshot()")

    def spend(self, n: int) -> None:
        self.reached += n
        if self.budget is not None and self.reached > self.budget:
            raise SnapshotError(f"{self.source}: refused: its shared references expand to more than "
                                f"{self.budget:,} entries ({EXPANSION_PER_BYTE} per byte of the file); a real "
                                "snapshot stays far below this", hint="this bounds the reader's memory and time")

    def seq(self, value, where: str) -> list | tuple:
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            self.fail(f"{where} is {_show(value)}, not a list")
        return value

    def mapping(self, value, where: str) -> None:
        if not isinstance(value, dict):
            self.fail(f"{where} is {_show(value)}, not a dict")

    def count(self, value, where: str, *, required: bool = False) -> None:
        if value is None and not required:
            return
        if not _is_count(value):
            self.fail(f"{where} is {_show(value)}, not a byte count or address (an integer from 0 to 2**64)")

    def frames(self, value, where: str) -> None:
        frames = self.seq(value, where)
        self.spend(len(frames))
        if id(frames) in self._frames_seen:
            return
        self._frames_seen.add(id(frames))
        self._keep.append(frames)             # (frame dicts are kept alive by the lists that hold them)
        for i, frame in enumerate(frames):
            if id(frame) in self._frames_seen:
                continue
            self._frames_seen.add(id(frame))
            if not isinstance(frame, dict):
                self.fail(f"{where}[{i}] is {_show(frame)}, not a frame dict")
            for key in ("filename", "name"):
                if not isinstance(frame.get(key, ""), (str, type(None))):
                    self.fail(f"{where}[{i}].{key} is {_show(frame.get(key))}, not text")
            line = frame.get("line", 0)
            if line is not None and not (type(line) is int and -(1 << 31) <= line < (1 << 31)):
                self.fail(f"{where}[{i}].line is {_show(line)}, not a line number")


def read_snapshot(path: str | Path, *, device: int | None = None, free_at: str = "free_completed",
                  top: int = 20) -> SnapshotReading:
    """Load and summarize one snapshot. Raises SnapshotError (see `load_snapshot_dict`)."""
    return summarize_snapshot(load_snapshot_dict(path), device=device, free_at=free_at, top=top,
                              source=str(path))


# ---------------------------------------------------------------------------------------------- normalizing

@dataclasses.dataclass
class _Blk:
    address: int
    size: int
    requested: int
    state: str
    raw_frames: Any


@dataclasses.dataclass
class _Seg:
    device: int | None
    address: int
    total_size: int
    is_small: bool
    is_expandable: bool
    blocks: list[_Blk]


@dataclasses.dataclass(frozen=True)
class _Entry:
    action: str
    addr: int
    size: int
    raw_frames: Any                   # converted on demand: most entries' frames are never looked at

    @property
    def frames(self) -> tuple[SourceLoc, ...]:
        return _frames(self.raw_frames)


@functools.lru_cache(maxsize=1 << 16)
def _loc(file: str, line: int, function: str) -> SourceLoc:
    return SourceLoc(file, line, function, "")


def _frames(raw: Any) -> tuple[SourceLoc, ...]:
    if not raw:
        return ()
    return tuple(_loc(str(f.get("filename", "") or ""), int(f.get("line", 0) or 0), str(f.get("name", "") or ""))
                 for f in raw if isinstance(f, dict))


def _segments(data: dict) -> list[_Seg]:
    out = []
    for seg in data.get("segments") or ():
        address = int(seg.get("address", 0))
        blocks, offset = [], 0
        for blk in seg.get("blocks") or ():
            size = int(blk["size"])
            history = blk.get("history") or ()
            last = history[-1] if history else {}
            requested = blk.get("requested_size", last.get("real_size", size))
            frames = blk.get("frames", last.get("frames"))
            blocks.append(_Blk(int(blk.get("address", address + offset)), size, int(requested),
                               str(blk.get("state", "inactive")), frames))
            offset += size
        total = int(seg.get("total_size", offset))
        seg_type = seg.get("segment_type")
        is_small = seg_type == "small" if seg_type is not None else total <= 2 * 2**20
        out.append(_Seg(seg.get("device"), address, total, is_small, bool(seg.get("is_expandable", False)),
                        blocks))
    out.sort(key=lambda s: s.address)
    return out


def _traces(data: dict) -> list[list[_Entry]]:
    out = []
    for dev_trace in data.get("device_traces") or ():
        out.append([_Entry(str(e["action"]), int(e.get("addr", 0) or 0), int(e.get("size", 0) or 0),
                           e.get("frames")) for e in dev_trace or ()])
    return out


def _device_view(data: dict, device: int | None, source: str) -> tuple[int, list[_Entry], list[_Seg]]:
    try:
        all_segments = _segments(data)
        traces = _traces(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"{source}: not a CUDA memory snapshot ({type(exc).__name__}: {exc})") from exc
    dev = _pick_device(traces, all_segments, device)
    trace = traces[dev] if dev < len(traces) else []
    return dev, trace, [s for s in all_segments if s.device is None or s.device == dev]


def _pick_device(traces: list[list[_Entry]], segments: list[_Seg], device: int | None) -> int:
    if device is not None:
        return device
    if any(traces):
        return max(range(len(traces)), key=lambda d: (len(traces[d]), -d))
    devices = sorted({s.device for s in segments if s.device is not None})
    return devices[0] if devices else 0


# ---------------------------------------------------------------------------------------------- frames

def _is_python(frame: SourceLoc) -> bool:
    return frame.line > 0 or frame.file.endswith(".py")


def is_user_frame(frame: SourceLoc) -> bool:
    """A Python frame of the user's own code: not torch, not the standard library, not site-packages.

    C++ frames (file `??`, empty, a `.cpp`/`.h` name, line 0) and generated code (`<string>`,
    `<eval_with_key>`, `<frozen ...>`) are not user frames.
    """
    file = frame.file
    if not file or file == "??" or file.startswith("<") or not _is_python(frame):
        return False
    if file.endswith(_CPP_SUFFIXES) or "/torch/" in file or _STDLIB.search(file):
        return False
    return True


def _is_backward_frame(frame: SourceLoc) -> bool:
    if not _is_python(frame):
        return any(marker in frame.function for marker in _BACKWARD_CPP)
    return frame.function in ("backward", "_engine_run_backward") or (
        "/torch/autograd/" in frame.file and frame.function == "grad")


_NONE, _BWD, _OPT, _WEAK_FWD, _WEAK_OPT = range(5)


@functools.lru_cache(maxsize=1 << 16)
def _frame_kind(frame: SourceLoc) -> int:
    if _is_backward_frame(frame):
        return _BWD
    if not _is_python(frame):
        return _NONE
    if "/torch/optim/" in frame.file:
        return _OPT
    name = frame.function
    if frame.file.endswith("/torch/nn/modules/module.py") or name == "forward":
        return _WEAK_FWD
    if is_user_frame(frame) and (name in ("step", "zero_grad") or "optimizer" in name.lower()):
        return _WEAK_OPT
    return _NONE


def classify_frames(frames: Sequence[SourceLoc]) -> str | None:
    """Phase of one allocation from its stack (innermost first). None when there are no frames.

    A strong marker decides at once, innermost first: the autograd engine (C++ `Engine::`, generated
    `*Backward*` nodes, AccumulateGrad) or a Python `backward` frame -> backward; a `torch/optim` frame ->
    optimizer. Otherwise the innermost weak marker decides: a module `forward` -> forward; a user function
    named `step`, `zero_grad` or `*optimizer*` -> optimizer. Otherwise forward (loss code, inputs).
    """
    if not frames:
        return None
    weak = None
    for frame in frames:
        kind = _frame_kind(frame)
        if kind == _BWD:
            return Phase.BACKWARD.value
        if kind == _OPT:
            return Phase.OPTIMIZER.value
        if weak is None and kind == _WEAK_FWD:
            weak = Phase.FORWARD.value
        elif weak is None and kind == _WEAK_OPT:
            weak = Phase.OPTIMIZER.value
    return weak or Phase.FORWARD.value


def _attribute(frames: Sequence[SourceLoc], *, before_trace: bool = False) -> tuple[SourceLoc | None, str]:
    """Innermost user frame, else (None, label): the autograd node that allocated, BEFORE_TRACE for a
    pre-trace block, AUTOGRAD_ENGINE for other engine allocations (e.g. validate_outputs), or ""."""
    for frame in frames:
        if is_user_frame(frame):
            return frame, ""
    for frame in frames:
        match = _AUTOGRAD_NODE.search(frame.function)
        if match:
            return None, match.group(1) or match.group(2)
    if before_trace:
        return None, BEFORE_TRACE
    return None, AUTOGRAD_ENGINE if any(_is_backward_frame(f) for f in frames) else ""


# ---------------------------------------------------------------------------------------------- replay

@dataclasses.dataclass
class _Life:
    address: int
    size: int
    start: int                        # alloc index, -1 before the trace
    end: int | None                   # index at which it stops counting, None = still live
    raw_frames: Any                   # stack of its alloc; for pre-trace blocks found by a free: of the free
    phase: str | None
    alloc_site: bool = True


def _replay(trace: list[_Entry], free_at: str) -> tuple[list[_Life], dict[int, _Life], int, list[str]]:
    """Walk the trace once: every block's life; pre-trace blocks discovered from frees get start -1.

    Returns (lives, live_or_pending_at_end by address, delayed free count, unknown actions).
    """
    lives: list[_Life] = []
    live: dict[int, _Life] = {}       # allocated, not yet free_requested
    pending: dict[int, _Life] = {}    # free_requested, waiting for free_completed
    delayed, unknown = 0, []

    def close(life: _Life, index: int) -> None:
        if life.end is None:
            life.end = index

    for i, e in enumerate(trace):
        if e.action == "alloc":
            stale = live.pop(e.addr, None) or pending.pop(e.addr, None)
            if stale is not None:     # its free fell outside the recorded entries: it ended here at the latest
                close(stale, i)
            life = _Life(e.addr, e.size, i, None, e.raw_frames, None)
            lives.append(life)
            live[e.addr] = life
        elif e.action == "free_requested":
            life = live.pop(e.addr, None)
            if life is None and e.addr not in pending:
                life = _Life(e.addr, e.size, -1, None, e.raw_frames, None, alloc_site=False)
                lives.append(life)
            if life is not None:
                pending[e.addr] = life
                nxt = trace[i + 1] if i + 1 < len(trace) else None
                if not (nxt and nxt.action == "free_completed" and nxt.addr == e.addr):
                    delayed += 1
                if free_at == "free_requested":
                    close(life, i)
        elif e.action in ("free_completed", "free"):
            life = pending.pop(e.addr, None) or live.pop(e.addr, None)
            if life is None:
                life = _Life(e.addr, e.size, -1, None, e.raw_frames, None, alloc_site=False)
                lives.append(life)
            close(life, i)
        elif e.action not in _KNOWN_ACTIONS and e.action not in unknown:
            unknown.append(e.action)
    return lives, {**live, **pending}, delayed, unknown


def _phases(trace: list[_Entry], lives: list[_Life]) -> list[str | None]:
    """Phase of every trace entry; also stamps each in-trace life with its alloc's phase."""
    has_frames = any(e.raw_frames for e in trace if e.action == "alloc")
    by_index = {life.start: life for life in lives if life.start >= 0}
    out: list[str | None] = []
    current: str | None = None
    for i, e in enumerate(trace):
        if e.action == "alloc" and has_frames:
            current = classify_frames(e.frames) or Phase.BACKWARD.value
            by_index[i].phase = current
        out.append(current)
    return out


def _summary(segments: list[_Seg]) -> SegmentSummary:
    free_sizes = [b.size for s in segments for b in s.blocks if b.state == "inactive"]
    active = [b for s in segments for b in s.blocks if b.state == "active_allocated"]
    small = [s.total_size for s in segments if s.is_small]
    large = [s.total_size for s in segments if not s.is_small]
    return SegmentSummary(
        count=len(segments), reserved_bytes=sum(s.total_size for s in segments),
        allocated_bytes=sum(b.size for b in active), requested_bytes=sum(b.requested for b in active),
        free_bytes=sum(free_sizes), largest_free_block_bytes=max(free_sizes, default=0),
        small_count=len(small), small_bytes=sum(small), large_count=len(large), large_bytes=sum(large),
        expandable_count=sum(s.is_expandable for s in segments), sizes=tuple(s.total_size for s in segments))


def _top_lines(blocks: Iterable[LiveBlock], top: int) -> tuple[LineBytes, ...]:
    acc: dict[tuple[str, int, str], list[int]] = {}
    for b in blocks:
        key = (b.source.file, b.source.line, b.source.function) if b.source else (NO_USER_FRAME, 0, b.label)
        row = acc.setdefault(key, [0, 0])
        row[0] += b.requested_bytes
        row[1] += 1
    rows = sorted(acc.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return tuple(LineBytes(f, line, fn, nbytes, n) for (f, line, fn), (nbytes, n) in rows[:top])


def summarize_snapshot(data: dict, *, device: int | None = None, free_at: str = "free_completed",
                       top: int = 20, source: str = "<snapshot>") -> SnapshotReading:
    """Timeline, peak, phases, reserved memory and top lines of one device of a loaded snapshot.

    Raises:
        SnapshotError: `free_at` is not one of FREE_ACTIONS, or the dict is not shaped like a snapshot.
    """
    if free_at not in FREE_ACTIONS:
        raise SnapshotError(f"{source}: free_at={free_at!r}; use one of {', '.join(FREE_ACTIONS)}")
    dev, trace, segments = _device_view(data, device, source)

    lives, at_end, delayed, unknown = _replay(trace, free_at)
    counted_states = {"active_allocated"} | ({"active_pending_free"} if free_at == "free_completed" else set())
    for seg in segments:
        for blk in seg.blocks:
            if blk.state in counted_states and blk.address not in at_end:
                lives.append(_Life(blk.address, blk.requested, -1, None, blk.raw_frames, None))
    event_phases = _phases(trace, lives)

    before = sum(life.size for life in lives if life.start < 0)
    delta = [0] * len(trace)
    for life in lives:
        if life.start >= 0:
            delta[life.start] += life.size
        if life.end is not None:
            delta[life.end] -= life.size
    timeline, running = [], before
    for d in delta:
        running += d
        timeline.append(running)

    peak_bytes, peak_index = before, -1
    for i, value in enumerate(timeline):
        if value > peak_bytes:
            peak_bytes, peak_index = value, i

    live_at_peak = []
    for life in lives:
        if life.start <= peak_index and (life.end is None or life.end > peak_index):
            frames = _frames(life.raw_frames) if life.alloc_site else ()
            src, label = _attribute(frames, before_trace=life.start < 0)
            live_at_peak.append(LiveBlock(life.address, life.size, life.start, life.phase, src, label))
    live_at_peak.sort(key=lambda b: (-b.requested_bytes, b.alloc_index, b.address))

    phases: dict[str, int] = {}
    for i, e in enumerate(trace):
        p = event_phases[i]
        if e.action == "alloc" and p is not None:
            phases[p] = max(phases.get(p, 0), timeline[i])
    phases = {p.value: phases[p.value] for p in Phase if p.value in phases}

    spans: list[tuple[str | None, int, int]] = []
    for i, p in enumerate(event_phases):
        if spans and spans[-1][0] == p:
            spans[-1] = (p, spans[-1][1], i)
        else:
            spans.append((p, i, i))

    reserved_end = sum(s.total_size for s in segments)
    reserved_timeline = [0] * len(trace)
    running = reserved_end
    for i in range(len(trace) - 1, -1, -1):
        reserved_timeline[i] = running
        running -= _RESERVED_DELTA.get(trace[i].action, 0) * trace[i].size
    reserved_start = running

    return SnapshotReading(
        source=source, device=dev, free_at=free_at,
        peak_bytes=peak_bytes, peak_index=peak_index,
        peak_phase=event_phases[peak_index] if peak_index >= 0 else None,
        phases=phases, before_bytes=before, end_bytes=timeline[-1] if timeline else before,
        end_bytes_from_segments=sum(b.requested for s in segments for b in s.blocks if b.state in counted_states),
        reserved_start_bytes=reserved_start, reserved_peak_bytes=max([reserved_start, *reserved_timeline]),
        reserved_end_bytes=reserved_end,
        top_lines=_top_lines(live_at_peak, top), live_at_peak=tuple(live_at_peak),
        timeline=tuple(timeline), reserved_timeline=tuple(reserved_timeline), phase_spans=tuple(spans),
        segments=_summary(segments),
        ooms=tuple(OomEvent(i, e.size, e.addr) for i, e in enumerate(trace) if e.action == "oom"),
        snapshot_indices=tuple(i for i, e in enumerate(trace) if e.action == "snapshot"),
        pre_trace_blocks=sum(1 for life in lives if life.start < 0),
        delayed_frees=delayed, ignored_actions=tuple(unknown))


# ---------------------------------------------------------------------------------------------- replay inputs

def replay_inputs(data: dict, *, device: int | None = None, source: str = "<snapshot>",
                  round_size: Callable[[int], int] | None = None) -> ReplayInputs:
    """The allocator's starting state and the request stream of one device, as plain numbers.

    Start state: the final segments minus those the trace allocated (plus none for segments it freed:
    their content is unknown, so a trace with `segment_free`/`segment_map`/`segment_unmap` raises).
    Live blocks at the start are the pre-trace blocks (see `summarize_snapshot`). A block still live at
    the end has its exact size from `segments`. A pre-trace block freed in the trace has only its
    requested size: its block is `round_size(requested)` plus, in a large segment, an unsplit tail:
    * the whole free gap after it when that gap is at most 1 MiB: every free block of the large pool is
      larger than 1 MiB (split remainders are > 1 MiB, freed blocks are > 1 MiB, merges only grow), so
      such a gap cannot be free;
    * for a larger gap, the trace decides: an allocation always takes the low end of a free block, so the
      first in-trace allocation that lands in the gap while the block is still live starts exactly at
      the block's end (accepted when that tail is at most 1 MiB);
    * otherwise no tail; such blocks are counted in `ambiguous_blocks`.
    `round_size(nbytes) -> int` defaults to rounding up to 512 B (the allocator default).

    Events free at `free_completed` (when the real allocator gets the block back).

    Raises:
        SnapshotError: the trace frees or maps segments, so the start state cannot be rebuilt.
    """
    from tracer.passes.allocator import SMALL_SIZE_BYTES, is_unsplit_tail, round_size as allocator_round_size
    round_size = round_size or allocator_round_size
    dev, trace, segments = _device_view(data, device, source)
    bad = sorted({e.action for e in trace if e.action in ("segment_free", "segment_map", "segment_unmap")})
    if bad:
        raise SnapshotError(f"{source}: the trace has {', '.join(bad)} entries; the segments that existed "
                            "when recording started cannot be rebuilt from the final state")
    new_segments = [e.addr for e in trace if e.action == "segment_alloc"]
    grown = frozenset(new_segments)
    start_segments = [s for s in segments if s.address not in grown]

    lives, at_end, _, _ = _replay(trace, "free_completed")
    pre_freed = {life.address: life for life in lives if life.start < 0}
    ids = {id(life): n for n, life in enumerate(lives)}
    out_segments, ambiguous, next_id = [], 0, len(lives)
    for seg in start_segments:
        starts: list[tuple[int, int | None, int, int]] = []   # (address, exact size or None, requested, id)
        for blk in seg.blocks:
            if blk.state in ("active_allocated", "active_pending_free") and blk.address not in at_end:
                starts.append((blk.address, blk.size, blk.requested, next_id))
                next_id += 1
        end = seg.address + seg.total_size
        for addr, life in pre_freed.items():
            if seg.address <= addr < end:
                starts.append((addr, None, life.size, ids[id(life)]))
        starts.sort()
        blocks = []
        for k, (addr, size, requested, block_id) in enumerate(starts):
            if size is None:
                size = round_size(requested)
                gap = (starts[k + 1][0] if k + 1 < len(starts) else end) - (addr + size)
                if is_unsplit_tail(seg.is_small, gap):
                    size += gap
                elif not seg.is_small and gap > SMALL_SIZE_BYTES:
                    tail = _first_alloc_in(trace, addr + size, addr + size + gap, pre_freed[addr].end)
                    if tail is not None and tail - (addr + size) <= SMALL_SIZE_BYTES:
                        size = tail - addr
                    else:
                        ambiguous += 1
            blocks.append(InitialBlock(block_id, addr, size, requested))
        out_segments.append(InitialSegment(seg.address, seg.total_size, seg.is_small, tuple(blocks)))

    events: list[tuple[str, int, int]] = []
    alloc_addresses = []
    live_ids: dict[int, int] = {}
    for life in lives:
        if life.start < 0:
            live_ids.setdefault(life.address, ids[id(life)])
    for e in trace:
        if e.action == "alloc":
            block_id = next_id
            next_id += 1
            live_ids[e.addr] = block_id
            events.append(("alloc", block_id, e.size))
            alloc_addresses.append(e.addr)
        elif e.action in ("free_completed", "free") and e.addr in live_ids:
            events.append(("free", live_ids.pop(e.addr), e.size))
    return ReplayInputs(tuple(out_segments), tuple(events), tuple(alloc_addresses), tuple(new_segments), ambiguous)


def _first_alloc_in(trace: list[_Entry], low: int, high: int, before: int | None) -> int | None:
    """Address of the first alloc in [low, high) among trace entries before index `before`."""
    for e in trace[:before]:
        if e.action == "alloc" and low <= e.addr < high:
            return e.addr
    return None
