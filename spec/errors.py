"""The error taxonomy of CUDA-graph machinery, shared by every backend.

One root, :class:`GraphError` (a :class:`RuntimeError`, so a plain ``except RuntimeError`` still
works), and two families: :class:`CaptureError` for anything that invalidates a capture, and
:class:`ReplayError` for what goes wrong when a captured graph runs again. Every class names the
spec clause it enforces in ``clause`` and carries the facts of the failure as fields; messages are
built by the class, so raisers pass data, not prose.

Bad *arguments* are not graph errors: they are :class:`ValueError` / :class:`TypeError` naming the
parameter and the value.

Conformance tests assert classes, never message text. On real CUDA some conditions can only be
observed as the family (a failed ``capture_end`` tells little), so a test may only assert the base.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AttentionInSegment",
    "BufferParity",
    "CaptureError",
    "CaptureInvalidated",
    "CollectiveMismatch",
    "DecisionMismatch",
    "CapacityExceeded",
    "ModeMismatch",
    "DefaultStreamCapture",
    "FreedMemoryAccess",
    "GraphError",
    "GraphNotEmpty",
    "GraphNotReady",
    "GraphStateError",
    "HostValueBaked",
    "MetadataNotUpgraded",
    "NestedCapture",
    "PoolClobber",
    "PoolNotReady",
    "ReplayDiverged",
    "ReplayError",
    "ResetDuringCapture",
    "StreamRace",
    "SyncDuringCapture",
    "UnjoinedStream",
    "UnsupportedInCapture",
]


class GraphError(RuntimeError):
    """Root of every error this project raises about graph capture or replay.

    ``clause`` is the id of the spec clause the error enforces (see :mod:`spec.clauses`).
    Subclasses accept structured fields and compose the message themselves; ``detail`` is an
    optional free-form tail (the backend's own words, e.g. the CUDA error string).
    """

    clause: str = "ERR-1"

    def __init__(self, message: str = "", *, detail: str | None = None) -> None:
        self.detail = detail
        text = message or (self.__doc__ or type(self).__name__).strip().splitlines()[0]
        if detail:
            text = f"{text} ({detail})"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the fields across pickling (pytest-xdist, multiprocessing) without re-running
        # subclass constructors whose signatures differ from RuntimeError's.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[GraphError], args: tuple[Any, ...], state: dict[str, Any]) -> GraphError:
    err = cls.__new__(cls)
    RuntimeError.__init__(err, *args)
    err.__dict__.update(state)
    return err


# ---------------------------------------------------------------------------------------------
# Lifecycle family (a graph method called in a state that does not allow it)
# ---------------------------------------------------------------------------------------------


class GraphStateError(GraphError):
    """A graph method was called in a lifecycle state (``spec.GraphState``) that does not allow
    it; nothing was changed. One leaf per misuse: :class:`GraphNotEmpty` (capture into a graph
    that holds one), :class:`ResetDuringCapture`, :class:`PoolNotReady`, :class:`GraphNotReady`
    (replay without a complete capture). ``state`` is the graph's state when it was raised."""

    clause = "LIFE-1"

    def __init__(self, message: str = "", *, state: str | None = None,
                 detail: str | None = None) -> None:
        self.state = None if state is None else str(state)
        if message and self.state is not None:
            message = f"{message} (graph is {self.state})"
        super().__init__(message, detail=detail)


# ---------------------------------------------------------------------------------------------
# Capture family
# ---------------------------------------------------------------------------------------------


class CaptureError(GraphError):
    """A capture could not be made, or was invalidated while it was being made.

    After any capture error the device is usable again: no capture is left open on any stream and
    the partial graph's memory is released. The partial graph itself must be ``reset()`` before it
    can capture again.
    """

    clause = "CAP-1"


class SyncDuringCapture(CaptureError):
    """Host synchronisation, or a read of device data by the host, was attempted during capture.

    Raised for ``.item()`` (``aten._local_scalar_dense``), ops whose output shape depends on data
    (``nonzero``, ``masked_select``, boolean-mask indexing), ops that return Python values
    (``torch.equal``), device/stream/event ``synchronize()`` and ``query()``. A CUDA graph records
    kernels, not host decisions: move the decision out of the captured region, or make it on data
    the host already has (a CPU copy made before capture).
    """

    clause = "CAP-2"

    def __init__(self, what: str, *, detail: str | None = None) -> None:
        self.what = what
        super().__init__(f"host synchronisation during capture: {what}", detail=detail)


class DefaultStreamCapture(CaptureError):
    """A capture was begun on the default (legacy) stream, which CUDA cannot capture.

    ``graph(g)`` without a stream captures on a side stream; pass ``stream=`` a non-default stream,
    or enter ``device.stream(s)`` before ``capture_begin()``.
    """

    clause = "CAP-3"


class NestedCapture(CaptureError):
    """A capture was begun while another capture is active on this device.

    End (or abort) the outer capture first. For breakable graphs, an eager region inside a capture
    is expressed with ``eager_on_graph``, never with a second capture.
    """

    clause = "CAP-4"


class UnjoinedStream(CaptureError):
    """A capture ended while a stream forked from the capturing stream was not joined back.

    A fork is ``side.wait_stream(capturing)`` during capture; its join is
    ``capturing.wait_stream(side)``. Every fork must be joined before ``capture_end()``.
    ``streams`` holds descriptions of the unjoined streams.
    """

    clause = "CAP-5"

    def __init__(self, streams: tuple[str, ...] = (), *, detail: str | None = None) -> None:
        self.streams = tuple(streams)
        names = ", ".join(self.streams) or "a forked stream"
        super().__init__(f"capture ended with unjoined forked stream(s): {names}", detail=detail)


class CaptureInvalidated(CaptureError):
    """The backend reported that the capture was invalidated, without saying why.

    CUDA's ``cudaErrorStreamCaptureInvalidated`` and similar errors at ``capture_end()`` land here
    when they cannot be mapped onto a more specific class. ``__cause__`` holds the original error.
    """

    clause = "CAP-6"


class UnsupportedInCapture(CaptureError):
    """The op cannot be captured faithfully by this backend (the fake names what it cannot model).

    Raised by the CPU fake for ops it cannot replay exactly as CUDA would (random number
    generation, ops with hidden host state). ``op`` is the op's name. Move the op outside the
    captured region, or run that test on the CUDA backend.
    """

    clause = "CAP-7"

    def __init__(self, op: str, *, detail: str | None = None) -> None:
        self.op = op
        super().__init__(f"operation cannot be captured by this backend: {op}", detail=detail)


# ---------------------------------------------------------------------------------------------
# Replay family
# ---------------------------------------------------------------------------------------------


class HostValueBaked(CaptureError):
    """A value read on the host at capture was frozen into the graph: two captures of the same
    padded size, made with different placeholder batches, recorded different work.

    A replay then computes with the capture's batch, not the live one (a Python int offset or
    length, a per-request loop bound, a shape derived from the batch, a host-computed scalar).
    Raised by the capture sanitizer (``SAN-1``) naming the first op that differs: ``index`` in
    capture order, ``op`` its name, ``argument`` which argument (``"op"`` when the ops
    themselves differ, ``"breaks"`` for the break sequence), ``values`` what the two captures
    recorded there, and ``frame`` (``"file:line"``) where the op was issued, when known.

    Fix: compute the value on the device from the batch's tensors, or move the work that needs
    it into an ``eager_on_graph`` break, which reads the live batch at every replay.
    """

    clause = "SAN-1"

    def __init__(
        self,
        op: str = "",
        index: int | None = None,
        argument: str = "",
        values: tuple[Any, Any] | None = None,
        frame: str | None = None,
        *,
        detail: str | None = None,
    ) -> None:
        self.op = op
        self.index = index
        self.argument = argument
        self.values = values
        self.frame = frame
        where = f" at {frame}" if frame else ""
        what = f"op {index} ({op})" if index is not None else op or "an op"
        seen = f": {values[0]!r} in one capture, {values[1]!r} in the other" if values else ""
        super().__init__(
            f"host value baked into the capture by {what}{where}, argument {argument}{seen}",
            detail=detail,
        )


class AttentionInSegment(HostValueBaked):
    """Batch-dependent attention ran inside a segment of a breakable capture, outside any break:
    a host value about to be baked in, caught before the capture ends (a :class:`HostValueBaked`).

    A segment replays what it recorded: extend attention (its per-request loop bounds, offsets
    and lengths) or any read of host-side per-request metadata made while a segment records
    would be frozen with the capture's placeholder batch, and every later replay would attend
    as if the step held that one request: wrong results for any batch of two or more requests,
    with nothing else raised (``MODEL-4``). ``layer_id`` names the layer (``None`` when the read
    was of metadata, not a layer's attention), ``what`` what ran.

    Fix: call :func:`impl.paged_attention` (it records the KV write in the segment and attends
    in an ``eager_on_graph`` break with ``save_kv_cache=False``), or put the attention call in
    a function decorated with ``@impl.eager_on_graph()``.
    """

    clause = "MODEL-4"

    def __init__(
        self, what: str = "", layer_id: int | None = None, *, detail: str | None = None
    ) -> None:
        self.what = what
        self.layer_id = layer_id
        self.op, self.index, self.argument, self.values, self.frame = what, None, "", None, None
        where = f" in layer {layer_id}" if layer_id is not None else ""
        CaptureError.__init__(
            self,
            f"{what or 'batch-dependent attention'}{where} ran inside a breakable graph segment, "
            "outside any break: replay would attend with the capture's placeholder batch. Call "
            "impl.paged_attention (KV write in the segment, attention as an eager_on_graph "
            "break), or decorate the attention call with @impl.eager_on_graph()",
            detail=detail,
        )


class GraphNotEmpty(CaptureError, GraphStateError):
    """A capture was begun into a graph that already holds one (``READY``) or a failed one
    (``FAILED``). Nothing was begun: the graph keeps its state, and a capture in progress
    elsewhere is not disturbed. ``reset()`` the graph first, or capture into a new graph
    (``LIFE-2``)."""

    clause = "LIFE-2"


class ResetDuringCapture(GraphStateError):
    """``reset()`` was called on a graph while its own capture is in progress. Nothing changed:
    the capture goes on and ends (or aborts) as it would have. Leave the capture first
    (``capture_end()``, or the end of the ``graph()`` / breakable-capture block), then reset
    (``LIFE-3``)."""

    clause = "LIFE-3"


class PoolNotReady(GraphStateError):
    """``pool()`` was called on a graph that holds no complete capture (``EMPTY``,
    ``CAPTURING`` or ``FAILED``). A graph's pool token exists once it is ``READY``, as with
    ``torch.cuda.CUDAGraph.pool()``; to share a pool from the start, pass a
    ``graph_pool_handle()`` token to every capture (``LIFE-4``)."""

    clause = "LIFE-4"


class ReplayError(GraphError):
    """A captured graph could not be replayed correctly."""

    clause = "RPL-1"


class GraphNotReady(ReplayError, GraphStateError):
    """``replay()`` was called on a graph with no complete capture (never captured, reset, or
    left ``FAILED`` by an error during capture). Capture it (again) first."""

    clause = "RPL-2"


class FreedMemoryAccess(ReplayError):
    """A replay (or a weak reference's resolution) touches memory whose owner was freed.

    A graph holds only addresses. Memory created outside the graph's pool (inputs made before
    capture) must be kept alive by the caller for as long as the graph may replay; a weak reference
    must be resolved before its target dies. ``block`` describes the memory, ``op`` the recorded op
    that touched it (``None`` for a weak-reference resolution).
    """

    clause = "MEM-3"

    def __init__(
        self, block: str = "", op: str | None = None, *, detail: str | None = None
    ) -> None:
        self.block = block
        self.op = op
        where = f" by {op}" if op else ""
        super().__init__(f"access{where} to freed memory {block}".rstrip(), detail=detail)


class PoolClobber(ReplayError):
    """A replay reads pool memory that another owner wrote after the writer it expects.

    Graphs that share a pool may re-use each other's freed blocks; that is safe only if they replay
    in capture order and no result is read after its block was handed on. ``block`` describes the
    memory, ``op`` the reading op, ``expected`` and ``found`` the writers.
    """

    clause = "MEM-4"

    def __init__(
        self,
        block: str = "",
        op: str | None = None,
        expected: str | None = None,
        found: str | None = None,
        *,
        detail: str | None = None,
    ) -> None:
        self.block = block
        self.op = op
        self.expected = expected
        self.found = found
        parts = [f"pool memory {block} was clobbered".strip()]
        if op:
            parts.append(f"read by {op}")
        if expected or found:
            parts.append(f"expected writer {expected}, found {found}")
        super().__init__("; ".join(parts), detail=detail)


class MetadataNotUpgraded(ReplayError):
    """A field of the *full* attention metadata was read from metadata that is still *raw*.

    Backends that build metadata in two halves (``init_forward_metadata_out_graph`` on the host,
    then ``init_forward_metadata_in_graph`` on the device, inside the graph) leave a cheap raw
    object after the first half; the second half upgrades it in place. A replay path that runs
    only the first half (the field regression after a buffer-registry refactor) would read stale
    or capture-time metadata; the raw object raises this instead. ``field`` names what was read.
    Fix: run ``init_forward_metadata_in_graph`` on the live batch (or record it in the graph).
    """

    clause = "RUN-5"

    def __init__(self, field: str = "", *, detail: str | None = None) -> None:
        self.field = field
        what = f" field {field!r}" if field else ""
        super().__init__(
            f"read of full attention metadata{what} before init_forward_metadata_in_graph "
            "upgraded it", detail=detail,
        )


class ReplayDiverged(ReplayError):
    """A replay's results differ from the same batch run eagerly (the replay shadow, ``SAN-2``).

    ``point`` names the first fixed point that differs (``"layer 3 KV write"``, ``"logits"``),
    ``step`` the runner's step number, ``raw_size`` and ``padded_size`` the batch's real and
    captured size, ``max_diff`` the largest absolute difference there and ``tolerance`` what
    the dtype allows. Usual causes: an input the replay did not refill, stale padded rows, a
    value baked at capture that this batch does not share.
    """

    clause = "SAN-2"

    def __init__(
        self,
        point: str = "",
        step: int | None = None,
        raw_size: int | None = None,
        padded_size: int | None = None,
        max_diff: float | None = None,
        tolerance: float | None = None,
        *,
        detail: str | None = None,
    ) -> None:
        self.point = point
        self.step = step
        self.raw_size = raw_size
        self.padded_size = padded_size
        self.max_diff = max_diff
        self.tolerance = tolerance
        super().__init__(
            f"replay diverged from eager at {point or 'a fixed point'} (step {step}, size "
            f"{raw_size} padded to {padded_size}): max difference {max_diff} above tolerance "
            f"{tolerance}", detail=detail,
        )


# ---------------------------------------------------------------------------------------------
# Stream order
# ---------------------------------------------------------------------------------------------


class StreamRace(GraphError):
    """Work on one stream touched memory that work on another stream wrote, or still reads, with
    nothing ordering the two: no ``wait_stream``, no event wait, no host synchronisation between
    them.

    Raised by a backend with the ``stream_order`` capability (the CPU fake) before the op runs,
    for an eager op or a graph replay issued on ``stream``:

    - that reads or writes memory whose last write was made on ``writer`` (``ORD-1``;
      ``written_by`` names the writing op);
    - that writes memory read on ``reader`` since its last write (``ORD-7``, a write after a
      read: ``read_by`` names the reading op, ``writer`` is empty). The overlapped-decode bug:
      a copy stream fills step ``n + 1``'s static inputs while step ``n``'s replay still reads
      them.

    On CUDA the same program has no error: its result depends on timing. ``op`` names the op
    (or ``"CUDAGraph.replay"``), ``block`` the memory, ``access`` is ``"read"`` or ``"write"``
    (what the racing op did), ``clause`` the clause it breaks.

    torch's side streams are non-blocking: nothing orders them with the default stream or with
    each other implicitly. Fix: ``stream.wait_stream(other)`` (or wait on an event recorded on
    ``other`` after its access) before the access.
    """

    clause = "ORD-1"

    def __init__(
        self,
        op: str = "",
        stream: str = "",
        writer: str = "",
        block: str = "",
        written_by: str | None = None,
        access: str = "read",
        *,
        reader: str | None = None,
        read_by: str | None = None,
        detail: str | None = None,
    ) -> None:
        self.op = op
        self.stream = stream
        self.writer = writer
        self.block = block
        self.written_by = written_by
        self.access = access
        self.reader = reader
        self.read_by = read_by
        if reader is not None:
            self.clause = "ORD-7"
            by = f" by {read_by}" if read_by else ""
            message = (f"stream race: {op} on {stream} writes {block}, still read{by} on "
                       f"{reader} with no wait between them")
        else:
            by = f" by {written_by}" if written_by else ""
            message = (f"stream race: {op} on {stream} {access}s {block}, last written{by} on "
                       f"{writer} with no wait between them")
        super().__init__(message, detail=detail)


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------


class CollectiveMismatch(GraphError):
    """Ranks issued different collectives at the same point of their sequences: what a real
    process group turns into a hang with no message (``TP-7``).

    Raised on every rank, by a multi-rank device (the fake's ranks as threads) that matches each
    rank's ``index``-th communicator call: another op, another shape or dtype, one rank replaying
    a graph while another runs eagerly or captures, or a rank that left the group (returned or
    raised: ``left``, rank -> how) while others wait for its ``index``-th call. ``sequences``
    holds, per rank, its :class:`spec.CollectiveRecord` calls up to and including ``index``
    (fewer for a rank that left); the message shows the last few of each.

    Usual causes: ranks that pad to different sizes (decide from every rank's counts), a rank
    that captures another size or none, capture orders that differ, a rank that falls back to
    eager while the others replay, a collective issued in one rank's warm-up only.
    """

    clause = "TP-7"

    def __init__(
        self,
        index: int | None = None,
        sequences: tuple[tuple[Any, ...], ...] = (),
        left: dict[int, str] | None = None,
        *,
        detail: str | None = None,
    ) -> None:
        self.index = index
        self.sequences = sequences
        self.left = dict(left or {})
        heading = (f"ranks disagree at collective #{index}" if index is not None
                   else "ranks disagree")
        super().__init__(self._with_sequences(heading), detail=detail)

    def _with_sequences(self, heading: str) -> str:
        """``heading``, then the last few calls of every rank (one line each)."""
        lines = [heading]
        for rank, seq in enumerate(self.sequences):
            shown = [r.describe() for r in seq[-3:]]
            if rank in self.left:
                shown.append(f"left the group ({self.left[rank]})")
            elif self.index is not None and len(seq) <= self.index:
                shown.append("(no call yet)")
            lines.append(f"  rank {rank}: " + "; ".join(shown or ["no collective"]))
        return "\n".join(lines)


class DecisionMismatch(CollectiveMismatch):
    """Ranks cannot take one decision for a step (``TP-2``): their batches are of different
    kinds (one rank decodes while another extends), or their runners differ (other capture
    ladders). Raised on every rank from the exchanged host values, before anything launches.
    ``decisions`` holds what each rank brought, in rank order; ``what`` names the decision."""

    clause = "TP-2"

    def __init__(
        self, what: str = "", decisions: tuple[Any, ...] = (), *, detail: str | None = None
    ) -> None:
        self.what = what
        self.decisions = decisions
        self.index, self.sequences, self.left = None, (), {}
        shown = "; ".join(f"rank {r}: {d!r}" for r, d in enumerate(decisions))
        GraphError.__init__(
            self, f"ranks cannot agree on {what or 'a decision'}: {shown}", detail=detail
        )


class CapacityExceeded(CollectiveMismatch):
    """A rank dispatched more rows to an expert than the all-to-all's fixed capacity holds
    (``EP-2``): the rows past the capacity are dropped, and the tokens they carry lose that
    expert's output, silently on a GPU (a capacity below ``bs * draft width``: SGLang
    #29942). Raised on every rank by a multi-rank device that reads the exchanged counts, at
    an eager call and at every replay (the counts are device data). ``counts`` holds, per
    rank, its counts ``[world, local_experts]`` as lists; ``capacity`` the slab's rows."""

    clause = "EP-2"

    def __init__(self, capacity: int = 0, counts: tuple[Any, ...] = (),
                 index: int | None = None, sequences: tuple[tuple[Any, ...], ...] = (), *,
                 detail: str | None = None) -> None:
        self.capacity = capacity
        self.counts = counts
        self.index, self.sequences, self.left = index, sequences, {}
        worst = [max((max(row) for row in c), default=0) for c in counts]
        shown = "; ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        GraphError.__init__(self, self._with_sequences(
            f"an all-to-all slab of capacity {capacity} was sent up to {max(worst or [0])} "
            f"rows for one expert (counts per rank, [destination][local expert]: {shown})"),
            detail=detail)


class BufferParity(CollectiveMismatch):
    """A low-latency all-to-all used another slot, or another layout, than the one its
    buffer's previous call cleaned for it (``EP-4``): DeepEP's double-buffer index is host state
    that flips at every call, and a graph bakes the slots of its capture, so one eager
    low-latency call between two replays (an odd number of calls), or graphs of different
    capacities sharing one buffer (DeepEP #93), send a replay into a slot that is not clean:
    corrupted counts or a hang on a GPU. Raised on every rank by a multi-rank device that keeps
    each buffer's state. ``states`` holds, per rank, ``(slot, capacity, ready_slot,
    ready_capacity)``: what the call used and what the previous call left clean (``None`` for
    either ready field after a clean, when anything may come)."""

    clause = "EP-4"

    def __init__(self, states: tuple[Any, ...] = (), index: int | None = None,
                 sequences: tuple[tuple[Any, ...], ...] = (), *,
                 detail: str | None = None) -> None:
        self.states = states
        self.index, self.sequences, self.left = index, sequences, {}
        shown = "; ".join(
            f"rank {r}: slot {s} of capacity {c}, clean: " +
            ("any" if rs is None else f"slot {rs} of capacity {rc}")
            for r, (s, c, rs, rc) in enumerate(states))
        GraphError.__init__(self, self._with_sequences(
            f"a low-latency all-to-all ran in a slot its buffer did not clean for it ({shown})"),
            detail=detail)


class ModeMismatch(CollectiveMismatch):
    """A low-latency all-to-all ran while its buffer was in normal mode (``EP-4``): a normal
    dispatch overwrites the low-latency slots, and only ``clean_low_latency_buffer()`` (a host
    call) makes them usable again, which a graph's replay does not make (SGLang #11666, the
    mode not restored before a decode replay). Raised on every rank by a multi-rank device;
    ``normal`` holds, per rank, whether its buffer was in normal mode."""

    clause = "EP-4"

    def __init__(self, normal: tuple[bool, ...] = (), index: int | None = None,
                 sequences: tuple[tuple[Any, ...], ...] = (), *,
                 detail: str | None = None) -> None:
        self.normal = normal
        self.index, self.sequences, self.left = index, sequences, {}
        shown = "; ".join(f"rank {r}: {'normal' if n else 'low latency'}"
                          for r, n in enumerate(normal))
        GraphError.__init__(self, self._with_sequences(
            f"a low-latency all-to-all ran on a buffer left in normal mode, with no "
            f"clean_low_latency_buffer() since (buffers: {shown})"), detail=detail)
