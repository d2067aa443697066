"""Clauses of breakable CUDA graphs (``BCG``) and of the CUDA device module (``CUDA``)."""

from .clauses import define

define(
    "breakable",
    [
        ("BCG-1", """After a complete breakable capture, len(segments) == len(breaks) + 1
            (num_segments and num_breaks report them); segments may be empty, and a capture
            with zero breaks replays like one ordinary graph."""),
        ("BCG-2", """replay() runs segment 0, break 0, segment 1, ..., the last segment, in that
            order, on the current stream, any number of times, each time equal to running the
            captured code eagerly on the current inputs."""),
        ("BCG-3", """During replay, breaks run on the stream replay() was called on (the device's
            current stream); where the part provides get_replay_stream(), it returns that
            stream during replay and None outside replay and capture.""", """get_replay_id() is
            0 during the capture-time call of a break, a positive counter that differs for every
            replay during replay, and None outside replay and capture."""),
        ("BCG-4", """Outside a breakable capture an eager_on_graph function is a plain call, and
            a function decorated with eager_on_graph(enable=False) is a plain call inside one
            too.""", """eager_on_graph(enable=False) returns the function itself."""),
        ("BCG-5", """Inside a breakable capture a decorated call ends the current segment, runs
            the function eagerly once, records one break, begins the next segment, and returns
            the eager result (result tensors that nothing else holds may come back as copies
            with the same values: BCG-7). Where the part takes them, barrier_fn is called
            before the eager call and capture_stub runs instead of the function at capture
            (neither at replay)."""),
        ("BCG-6", """At replay a break calls its function with the capture-time argument objects
            (an autograd-tracked parameter, a lazily negated or conjugated view: as they are, or
            refused at capture, never replayed without their negation). What the break returns
            follows one of two contracts, which the backend declares: result copying (the
            capability break_result_copy: SGLang and the reference) copies the result in place
            into the capture-time result, tensors directly, tuples and lists element-wise, dicts
            and objects field-wise, a result that is the capture-time object or None not
            copied, a result in a nested container or an object with __slots__ handled so or
            refused at capture; in-place writes (vLLM) have the break write outputs its caller
            allocated and return nothing or one of its arguments, replay discarding what it
            returns, and an engine of this contract may refuse a fresh result at capture.
            Either way no break output is replayed with capture-time values.""", """Result
            copying: nested containers, objects with __slots__ and lazily negated or conjugated
            arguments are all supported."""),
        ("BCG-7", """Replay stays correct after the caller dropped every reference to the break
            inputs and capture-time results, also after another size was captured into the same
            pool and replayed on the capture stream.""", """The graph owns every break input and
            result until reset(), except scratch: memory its own capture allocated in its pool
            (segment outputs, and the pool copies of the results the capture-time call
            allocated and did not keep, where the device tracks scratch), held without keeping
            it allocated, so later captures into the pool re-use it; what a break's call keeps
            stays itself, outside the pool. Scratch a break reads must be rewritten by every
            replay before the read (a buffer a segment only allocates is written by the break
            at every call)."""),
        ("BCG-8", """A decorated call made inside another break's eager body runs inline and
            records no break of its own."""),
        ("BCG-9", """A stream forked from the capture stream and joined back before a break
            captures and replays correctly. One left open across a break is either joined back
            automatically before the segment ends or refused loudly at capture, leaving no
            capture, no active capture context and the device usable.""", """Forks are joined
            automatically, and an explicit join of a fork that is no longer capturing is a
            no-op; the wait_stream hook exists only while a capture is in progress."""),
        ("BCG-10", """An exception inside a breakable capture leaves no capture open and the
            device usable and propagates to the caller: the model's own exception unchanged
            (never replaced by a failure to end the segment), a capture error of a segment as a
            RuntimeError, a failure of capture setup (the default stream, a wait on a stream
            used eagerly, a capture begun inside a break body) at least as a RuntimeError (the
            engine's or the device's own error). A decorated call afterwards is a plain call,
            and a new capture into a fresh or reset graph replays correctly.""",
            """Each failure is the exact spec CaptureError (a capture inside a break body:
            NestedCapture); the partial graph refuses to replay with GraphNotReady until
            reset() and a new capture; the stream hook and the context variables are
            restored."""),
        ("BCG-11", """Where the part provides the switch, enable_breakable_cuda_graph() makes
            is_in_breakable_cuda_graph() true for its body and false again after it; it is true
            during every breakable capture and replay, whether the capture context or the
            runner around it switches it on.""",
            """A breakable capture switches it on for its body by itself. Re-entrant: nested
            uses, one instance entered several times, and exceptions restore the previous value
            each time."""),
        ("BCG-12", """Given pool=, all segments of a breakable graph allocate from that pool;
            graphs of several sizes captured into one pool, largest first, each replay
            correctly.""", """Without pool=, all segments share one pool, whose token
            graph.pool() returns and a later capture accepts."""),
        ("BCG-13", """Where the part provides break_graph(), it splits a breakable capture with
            an empty break and is a no-op outside a capture."""),
    ],
)

define(
    "cuda",
    [
        ("CUDA-1", """is_stream_capturing(stream) is true for the capturing stream and for a
            stream forked from it during the capture, and false for both once the capture
            ended."""),
        ("CUDA-2", "", """A backend failure during or at the end of a capture is raised as a
            spec CaptureError whose __cause__ is the backend's original error."""),
        ("CUDA-3", """graph_node_count(graph) of a graph captured with keep_graph=True counts its
            recorded work items: one per elementwise in-place op."""),
        ("CUDA-4", """A graph that dies while another capture is active (its last reference
            dropped, or a garbage collection run inside the capture collecting a cycle that
            holds it) does not disturb that capture: the capture ends, and replays, as if the
            graph had died before it. Core: on CUDA, destroying a graph during a global-mode
            capture invalidates the capture, and Python's collector runs at arbitrary
            allocations."""),
    ],
)
