"""Clauses of the device protocol, of memory pools, and of the CPU fake device."""

from .clauses import define

define(
    "device",
    [
        ("DEV-1", """Stream, Event and CUDAGraph are classes reachable as attributes of the device
            module, and Stream.wait_stream is looked up on the class: wrapping
            device.Stream.wait_stream affects every stream of the device."""),
        ("DEV-2", """current_stream() returns an instance of the device's Stream class: the
            default stream until stream(s) makes s current for its body, after which the
            previous stream is current again."""),
        ("DEV-3", """is_stream_capturing(s) is true exactly while s is the capturing stream of a
            capture in progress or a stream forked into it; is_current_stream_capturing() says
            the same of the current stream."""),
        ("DEV-4", """graph(g, pool, stream) makes the capture stream current for its body, ends
            the capture when the body returns, aborts it and re-raises when the body raises,
            and restores the previous current stream either way."""),
        ("DEV-5", """For a graph with a complete capture, graph_node_count(g) equals
            len(graph_op_names(g))."""),
        ("DEV-6", """weak_ref_tensor(t) keeps nothing alive; while t's memory is live and still
            t's, resolve_weak_ref returns a tensor with t's shape, stride and dtype on t's
            memory."""),
        ("DEV-7", """Work issued on a stream forked into a capture is recorded into the same
            graph, in issue order, and runs when the graph replays."""),
        ("DEV-8", """CUDAGraph(keep_graph=...) accepts keep_graph, and pool() returns a token
            that a later capture can pass as pool= to share the graph's memory."""),
    ],
)

define(
    "memory",
    [
        ("MEM-1", """Memory allocated during a capture (fresh outputs, factory results) comes
            from the capture's pool: the graph's private pool, or the pool passed as pool= (a
            graph_pool_handle() token or another graph's pool())."""),
        ("MEM-2", """A pool block whose last tensor died returns to its pool and is handed,
            smallest fitting block first, to a later allocation of that pool, including one by a
            later capture sharing the pool; a pool's blocks are never released while a graph
            captured into it, a token for it, or a tensor on one of its blocks is alive."""),
        ("MEM-5", """A graph's replays may read and write pool memory whose capture-time tensors
            died: the graph keeps its pool alive."""),
        ("MEM-6", """A graph holds memory outside its own pool (tensors made outside capture,
            blocks of other pools) weakly: it keeps none of it alive. A replay after a tensor
            made outside capture died, or after a block of another pool was handed to another
            allocation or its pool released, raises FreedMemoryAccess before running anything;
            a block of another pool whose tensor died but which its pool still reserves is read
            as it is, as on CUDA. A tensor built over a block's address (a storage from its data
            pointer) is that block."""),
        ("MEM-7", """Graphs captured in sequence into one pool and replayed in capture order,
            with eager code between them that reads earlier graphs' outputs and writes tensors
            later graphs read, never raise PoolClobber or FreedMemoryAccess for their
            temporaries or for values passed from one graph to the next."""),
        ("MEM-8", """On the fake, a replay read raises PoolClobber when the block's last write
            was made for another allocation of the block than the one read, and either the
            capture expected a graph's write of the read allocation or the write found belongs
            to a later allocation; writes to the same allocation, by any graph, never do."""),
        ("MEM-9", """A later capture sharing a pool re-uses blocks freed by earlier captures:
            once an earlier capture's temporaries died, the shared pool ends with fewer blocks
            than the same captures in private pools."""),
    ],
)

define(
    "fake",
    [
        ("FAKE-1", """Importing fakes registers 'fake': spec.get_device('fake') returns a new
            FakeDevice, whose device is torch.device('cpu') and whose name is 'fake'."""),
        ("FAKE-2", """During a capture the fake runs no kernel: each fresh output of a recorded
            op holds the poison pattern (NaN for floating dtypes, poison_value(dtype) for
            integer dtypes, True for bool), and in-place and out= targets are unchanged until
            replay."""),
        ("FAKE-3", """A replay gives what running the captured program eagerly on the memory's
            contents at replay time gives: integer and bool values bit for bit, float values
            within rounding."""),
        ("FAKE-4", """N replays of a graph leave the same memory state as N eager runs of the
            captured program from the same initial state."""),
        ("FAKE-5", """Once FakeDevice() has returned, capturing and replaying a program imports
            no further module (construction warms up the recorder's lazy imports)."""),
        ("FAKE-6", """cache_info() is a frozen snapshot; once every graph, pool token and tensor
            of a device is gone it reports no pool and no live block (the leak invariant)."""),
        ("FAKE-7", """Host reads that bypass the dispatcher (tolist(), numpy(), printing) are not
            detected during a capture, and read the poison pattern."""),
        ("FAKE-8", """During a capture, ops issued on a stream that is not part of it run
            eagerly, as on CUDA; host syncs among them follow capture_error_mode."""),
        ("FAKE-9", """With capture_error_mode='relaxed', querying or synchronizing a stream or
            event unrelated to the capture is allowed; with 'global' or 'thread_local' it raises
            SyncDuringCapture on the capturing thread; syncs involving the capture raise in
            every mode."""),
        ("FAKE-10", """The fake records each aten op that launches a kernel, with the memory it
            reads and writes; views, allocations (empty and friends) and metadata ops record
            nothing; graph_op_names lists recorded ops as aten names, in capture order."""),
        ("FAKE-11", """A capture error aborts the capture at once: capture_end() on the aborted
            graph raises that error again, replay() raises GraphNotReady, and capture_begin()
            raises CaptureError until reset()."""),
        ("FAKE-12", "", """The fake's registry of special-case ops rejects a second handler for
            the same op, or the same predicate, with ValueError."""),
    ],
)
