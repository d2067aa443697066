"""Clauses of the capture sanitizer (``SAN``): what ``impl``'s runners with ``sanitize=`` always
detect and never flag. The reference's promises (strict): engines' own runners have no
sanitizer; a device takes part through the optional ``captured_ops`` and ``record_frames``."""

from .clauses import define

define(
    "sanitizer",
    [
        ("SAN-1", "", """With sanitize="captures" (or "all"), every size a runner captures is
            captured a second time with another placeholder batch of the same padded shape
            (other request counts, lengths, positions) into a private pool, reset at once and
            never replayed; a capture whose recorded work depends on a host value of the
            placeholder (an offset or length read on the host inside a segment, a
            host-computed scalar, per-request rows selected inside the graph, a tensor built
            from host lists) raises HostValueBaked at capture, naming the first differing op,
            the argument, both values and the file:line that issued the op, on a device that
            reports recorded programs; on one that shows only kernel names (CUDA), a
            difference in work items or kernels. impl.capture_diff does the same for any
            function."""),
        ("SAN-2", "", """With sanitize="replays" (or "all"), every replay a ModelRunner serves
            (decode runner, breakable prefill runner) and every graph route of the manager is
            checked against the same
            batch run eagerly with a second attention backend over a clone of the KV cache:
            a replay whose KV writes (per layer, in order) or logits differ beyond the dtype's
            tolerance raises ReplayDiverged naming the first diverging point, the step, the
            raw and padded size and the largest difference; the shadow writes neither the live
            cache nor the graphs' metadata buffers."""),
        ("SAN-3", "", """The sanitizer never flags a correct model: with sanitize="all" every
            reference model kind serves random batches with eager's results and nothing
            raised; with sanitize="off" (the default) no frame is recorded and no second
            capture is made."""),
    ],
)
