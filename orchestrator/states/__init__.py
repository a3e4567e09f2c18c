"""The target's states: one home for what extraction writes, training and eval read, and every capture engine
assembles.

    shards.py    a sequence's states (`SequenceStates`), the shard format, its writer and its checked reader
    assemble.py  an engine's raw per-layer output to `SequenceStates`: the token check, the final norm, the dtype
    manifest.py  the extraction manifest's check against a run's config
    source.py    `StateSource`, what training and eval read states from, and the order they ask for them in
"""
