"""Clauses of expert parallelism under graphs (``EP``): the experts of a mixture-of-experts
layer sharded over ranks, tokens dispatched to them and combined back with a fixed-capacity
all-to-all recorded inside decode graphs and breakable segments; and of data-parallel attention
(``DP``): ranks holding different batches, or none, stepping through one graph."""

from .clauses import define

define(
    "expert",
    [
        ("EP-1", """A mixture-of-experts model whose experts are sharded over the ranks (each
            rank holds num_experts / world_size of them; every token dispatched to the ranks
            of its top-k experts and combined back through Communicator.all_to_all) gives on
            every rank the tokens, and within the dtype's tolerance the logits, of the same
            model on one rank: eagerly, with its all-to-alls recorded in decode graphs, and in
            breakable segments (every rank issues the same all-to-alls of the same shapes,
            whether it has tokens for them or not)."""),
        ("EP-2", """Capacity: the all-to-all's slab holds a fixed number of rows per expert and
            source rank, which must hold every row a step can send (at least the padded token
            count of the largest captured size, times the draft width for a verify step): a
            count above it drops tokens silently on a GPU (SGLang #29942, a capacity below
            bs * draft width).""", """The multi-rank fake reads the exchanged counts at every
            eager call and every replay and raises CapacityExceeded on every rank, with every
            rank's counts."""),
        ("EP-3", """Padding is not load: a step's padded rows (and an idle rank's dummy
            batch) are dispatched to no expert and never counted as expert load, so the
            experts' load after a generation with graphs equals the load of the same
            generation run eagerly (vLLM #38128, padding tokens counted as expert load skewing
            the routing statistics)."""),
        ("EP-4", """Low-latency buffers (DeepEP's): a graph bakes the buffer slots its capture
            used, and a replay neither flips the host's slot index nor cleans, so every
            low-latency call, eager or replayed, must find its slot clean in its own layout and
            the buffer in low-latency mode. An engine keeps one capacity per buffer for every
            graph that shares it (graphs of different num_max_dispatch_tokens_per_rank on one
            buffer corrupt the counts: DeepEP #93), issues an even number of low-latency calls
            per step, and cleans the buffer on the host before the first low-latency step or
            replay after a normal-mode step (SGLang #11666, the mode not restored before
            replay).""", """The multi-rank fake keeps each buffer's clean slot, layout and
            mode as device state, checks them at every low-latency call, eager or replayed,
            and raises BufferParity or ModeMismatch on every rank; the reference's extend
            steps run eagerly in normal mode and decode steps and graphs in low latency
            (deepep_mode="auto"), one capacity for every graph (a graph of more rows than it
            holds is refused by name before capture, as DeepEP asserts), and its capture ladders
            restore the low-latency mode before each replay (the before_replay step)."""),
    ],
)

define(
    "data_parallel",
    [
        ("DP-1", """Data-parallel attention: ranks that hold different batches (other request
            counts, other lengths) of a model whose experts are sharded step together: every
            rank's batch is padded to the largest of the ranks' captured sizes and every rank
            replays that size's graph, or every rank runs eagerly; each rank's tokens equal its
            own requests' tokens on one rank (a rank that pads by its own count replays another
            graph, and the all-to-all's shapes no longer pair up: vLLM #25906).""",
         """The reference exchanges each rank's mode, rows and key on the host; ranks whose
            steps are of different modes (one decodes while another extends) get
            DecisionMismatch on every rank before anything launches."""),
        ("DP-2", """An idle rank (no request this step) runs a dummy batch through the same
            graph the other ranks replay, never eagerly while they replay (SGLang #37933: an
            idle rank running eagerly deadlocks the expert all-to-all); the dummy batch reads
            the dummy row, writes the dummy KV slot only, and is no expert's load."""),
    ],
)
