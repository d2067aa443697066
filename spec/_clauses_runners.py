"""Clauses of the graph runners (``RUN``): the decode runner, the breakable prefill runner, and
the graph manager, each checked against the eager ground truth."""

from .clauses import define

define(
    "runners",
    [
        ("RUN-1", """For a hybrid sliding-window model, the decode runner installs the registry's
            out_cache_loc_swa buffer with set_swa_loc before warmup and capture, so each decode
            graph records no per-layer translation: it has exactly one translation's work items
            per SWA layer fewer than the same runner on the slow path. An optional runner
            feature: a runner without the swa_fast_path and keep_graph options is skipped."""),
        ("RUN-2", """A decode replay padded from a smaller batch than an earlier replay changes no
            live request's KV (full and sliding-window pools) except at the positions written
            this step: padded rows write only the dummy slot."""),
        ("RUN-3", """Padded rows of every token-axis input a model op reads (positions) hold
            benign values after each fill, so an op that reduces over the whole padded input
            gives the eager result after the batch shrinks."""),
        ("RUN-4", """Work that depends on a replay's inputs is recorded in the graph at capture:
            no cache keyed on an address or object identity, filled during warmup, may skip it
            (SWA locations are translated at every replay on the slow path)."""),
        ("RUN-5", """Attention metadata is built in two halves; the in-graph half is recorded in
            each decode graph (or run before every replay), so replay never reads the capture
            batch's metadata; reading a full field of metadata that the in-graph half did not
            upgrade raises MetadataNotUpgraded, never returns stale data."""),
        ("RUN-6", """The in-graph metadata half writes into buffers allocated once, never into new
            tensors per call, so a runner that prepares metadata before replay writes where the
            graph reads."""),
        ("RUN-7", """The breakable prefill runner captures only the layer stack, with a one-request
            placeholder batch; replaying it for any batch of 1..max requests whose token count
            fits gives the eager next-token logits of every request."""),
        ("RUN-8", """Before a breakable prefill replay both metadata halves run on the live,
            unpadded batch, before any captured op or forked side stream reads the metadata."""),
        ("RUN-9", """A RunnerModel (MODEL-1) without get_layer_stack() gives correct results
            through the prefill runner: when its usual attributes (language_model, model) lead
            to a module with layers, that module is captured as the layer stack of MODEL-3 and
            must take that call (a model whose inner module does not provides
            get_layer_stack()); when they lead nowhere, every batch runs eagerly (never a
            crash). A model without a runner config, such as a bare transformers model, is
            refused before any of this (MODEL-1).""",
         """Both cases log a warning; the resolved model is captured once per size, the
            unresolved one not at all and never replayed."""),
        ("RUN-10", """The dispatcher pads to the smallest captured size >= n and picks FULL with
            the exact descriptor, else PIECEWISE with the relaxed one (num_reqs=None), else
            NONE; the manager runs each (mode, batch kind) pair on that path, a FULL replay
            records no break, and a draft model's prefill through run_pw_graph and its decode
            loop through run_draft_decode (FULL only, eager in a mode without full graphs)
            equal eager."""),
        ("RUN-11", """Graph replay equals eager: decode graphs for every captured size and the raw
            sizes between them, and breakable prefill, over many steps with requests joining
            and leaving, on every reference model kind (tokens equal, logits within 1e-3)."""),
        ("RUN-12", """A graph runner built from a graph target alone (never the model runner)
            decides once per step from host values, decide(batch) -> key or None, then
            run(key, batch) trusts the key; with the caller running a declined batch eagerly,
            every batch gives eager's results: those it serves by replay (at most its largest
            captured size) and those it declines.""",
         """Captures, replays and eager fallbacks are counted in the runner's own stats: one
            capture per size, one replay per served batch, one fallback per batch its decide
            declined, whichever object then ran it eagerly."""),
        ("RUN-13",
         """Overlapped decode (generate(overlap=True)) gives the tokens and logits of the
            unoverlapped mode for the same prompts and limits: step n + 1 is prepared on the host
            while step n runs and staged on another stream, which waits on an event recorded
            after step n's replay before it writes anything that replay reads (ORD-7), and
            step n's tokens reach step n + 1's input ids on the device.""",
         """The reference overlaps without host round trips: the decode graph records the
            argmax, host values reach the device through one non-blocking copy per step, and
            the host synchronizes once per generation. A staging stream that skips its wait
            on step n is a StreamRace on the fake."""),
        ("RUN-14",
         """Nothing leaked: whatever raises in the middle of generate (the model, a graph
            runner or its hook, a step the ranks refuse, a KeyboardInterrupt), in both modes
            (overlap=True included, a step staged but not launched too) and with graphs on or
            off, every request of that call gives its request row and KV slots back, each
            exactly once, before the exception leaves generate: the KV pool's free token slots
            and free request rows are those before the call. On several ranks this holds on
            every rank, the raising one and the ones that fail because it left. The next
            generate on the same runner equals eager.""",
         """The exception that leaves generate is the one raised, unchanged (the same
            object), also when giving the requests back fails too: that failure is added to
            it as a note, never raised in its place."""),
    ],
)
