"""Clauses of the graph input-buffer registry and of the shared input-buffer pool.

Core parts say what a graph reads after a fill (buffer contents, pad values, memory identity by
storage and address); strict parts are the reference registry's stronger promises (argument
validation, exact error classes, immutable declarations, checks before any write, launch
structure). Optional builder features (the SWA slot, mamba and encoder slots) are probed: a
builder without the option is skipped for them, never failed.
"""

from .clauses import define

define(
    "registry",
    [
        ("REG-1", "", """GraphSlot raises ValueError for an unknown axis, for axis 'none' with a
            policy other than KEEP_PAD or FOREACH_COPY, and for FILL_SENTINEL or FILL_ONCE
            without a pad_value; TypeError for a dtype, shape_fn, policy or post_fill of the
            wrong type; KEEP_PAD and FOREACH_COPY are accepted on axis 'none'."""),
        ("REG-2", """Registration creates the slot's buffer with shape shape_fn(max_bs,
            max_num_tokens) on the slot's device (else the registry's): zeros, or pad_value
            everywhere for FILL_SENTINEL and FILL_ONCE. The buffer never moves afterwards (same
            storage and data_ptr across fills).""", """The slot's declaration is fixed once
            registered (setting a field raises AttributeError), and a duplicate name raises
            ValueError."""),
        ("REG-3", """On a fill with raw < padded, the pad region [raw:padded] along the slot's
            axis is re-zeroed (ZERO), re-filled with pad_value (FILL_SENTINEL), or left as it is
            (KEEP_PAD, FOREACH_COPY, FILL_ONCE). Rows at or beyond padded are never touched by the
            pad reset or the copies."""),
        ("REG-4", """A fill runs pad reset on every enabled slot, then the head copies, then the
            post_fill hooks in registration order, each hook given the whole buffer: a head copy
            that overlaps the pad region wins over the pad reset."""),
        ("REG-5", """The head [0:raw] of a slot is copied from the batch attribute of the slot's
            name (skipped when missing or None, or with copy_from_fb False); with source_fn, from
            its result into the source-length prefix (skipped when None), on a slot padded along
            dimension 0. A fill of valid sources is accepted.""", """A dotted name of a
            plain-copy slot resolves as an attribute path on the batch (grp.s0 reads
            batch.grp.s0), and source_fn is honoured on a slot padded along any dimension.
            (launch structure, capability launch_structure) Copies into dense device
            destinations are grouped by (destination dtype, source dtype) into one foreach copy
            per group, strided ones are copied on their own, and host destinations of a device
            registry are copied after all of them; pad resets are one foreach zero per
            dtype."""),
        ("REG-6", """slot.slice_for(padded_bs, padded_num_tokens) returns a view, never a copy,
            of the padded prefix (slice_fn's when given; the whole buffer for axis 'none'):
            it shares the buffer's storage, and writes through it land in the buffer.""",
            """Before the slot has a buffer slice_for raises RuntimeError, and registration
            rejects with ValueError a slice_fn that cuts more than one dimension or returns a
            copy."""),
        ("REG-7", "", """A fill raises ValueError naming the problem, and writes nothing, when
            raw > padded, when padded exceeds the registry's maximum, when a size is negative,
            when a plain source's length along the slot's axis differs from the raw count, or
            when a source_fn source is longer than the buffer."""),
        ("REG-8", """extract_buffer returns a batch whose slot fields are the padded views and
            whose batch_size is padded_bs, other fields as in the template; a plain slot whose
            template field is None stays None; computed slots (post_fill, or copy_from_fb False)
            are always exposed; dotted slot names are not passed to replace.""", """The result
            is a new object (the template is not mutated); a template that is not a dataclass
            raises TypeError, and a padded size above the maximum ValueError."""),
        ("REG-9", """build_decode_registry declares at least input_ids (FOREACH_COPY), positions,
            out_cache_loc, req_pool_indices, mrope_positions (ZERO), seq_lens and seq_lens_cpu
            (FILL_SENTINEL with seq_len_fill_value, the latter on the host), with the listed
            axis, dtype and shape; extra slots are allowed. Builder features, probed and skipped
            where the builder lacks the option: out_cache_loc_swa (int32, ZERO) for hybrid SWA
            (is_hybrid_swa), mamba tracking slots (ZERO, enable_mamba_track) and encoder_lens
            (int32, FILL_ONCE with encoder_len_fill_value, is_encoder_decoder).""", """No other
            slots: the plain builder declares exactly those seven."""),
        ("REG-10", """build_prefill_registry declares at least input_ids, positions,
            out_cache_loc with ZERO, and for multimodal models mrope_positions (ZERO) and
            input_embeds (ZERO, reset only: copy_from_fb False); extra slots are allowed. Builder
            features, probed and skipped where the builder lacks the option: out_cache_loc_swa
            (int32, ZERO) for hybrid SWA and FOREACH_COPY mamba tracking slots.""", """No other
            slots, and a multimodal registry without a positive hidden_size and an embed_dtype
            raises ValueError."""),
        ("REG-11", """register_slot(slot, bind=t) adopts t (the slot's buffer is t's memory:
            same storage and data_ptr); a bound tensor is never pooled and never re-filled at
            registration. With source=, the builders bind every slot to the source's field of
            that name.""", """A bound tensor of the wrong shape, dtype or device raises
            ValueError, a non-tensor TypeError, and a source missing a field ValueError."""),
        ("REG-12", """A disabled slot is kept (get_slot finds it) but gets no buffer, is not
            reported by has_slot or slot_names, and is neither filled nor exposed.""",
            """get_slot of a name never registered raises KeyError."""),
        ("POOL-1", """share_input_buffer keys the process-wide pool by (name, numel, dtype,
            device): two requests share memory if and only if all four parts are equal.""",
            """An empty name or a non-contiguous tensor raises ValueError, a non-tensor
            TypeError."""),
        ("POOL-2", """The first registrant for a key is canonical: it gets its own memory back
            (equal storage and data_ptr, not necessarily the same object); later requests get a
            view of it (same data_ptr) shaped like their own tensor. A request with a different
            key never displaces the canonical buffer, whatever the order of requests."""),
        ("POOL-3", """clear_input_buffer_pool empties the pool: the next request for a key becomes
            canonical again."""),
        ("POOL-4", """A registry with share_pool=True takes its buffers from the pool and applies
            the sentinel fill after pooling; joining an existing pooled buffer never re-zeroes
            it.""", """A rejected registration changes no pooled buffer (checks before any
            write)."""),
    ],
)
