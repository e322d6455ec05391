"""Where experts live and how they move: the slow tier (:mod:`.store`), the device slots
(:mod:`.slots`: per-layer and shared pools; :mod:`.eviction`; :mod:`.cache`: one layer's
residency), the copies into them (:mod:`.loader`) over the link (:mod:`.link`: CPU copy
thread with optional emulation, CUDA copy streams), expert compute on the host
(:mod:`.host`), and host <-> device staging of small index arrays (:mod:`.staging`)."""
