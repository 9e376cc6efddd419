"""How long the engine's threads wait for what: the timing constants its parts share.

Each value says what it bounds and why it is what it is; settings a user may change live in
:mod:`hora.common.vocabulary.config`, not here.
"""

from __future__ import annotations

# Park after this many consecutive cycles in which no rank had anything new (at least ~5 ms).
PARK_AFTER_IDLE_S = 0.005
# While its own collectives are on the wire, a rank with nothing new joins idle exchanges this
# often at most (it joins at once when they land or work arrives): other ranks with news for a
# process set it is not busy in wait this long at worst.
HOLD_WHILE_IN_FLIGHT_S = 0.05
# How often a parked or waiting thread looks at the store for failures.
WATCH_INTERVAL_S = 0.5
# Started allreduces awaiting completion before the engine waits to start another.
MAX_STARTED = 16
# In the steady state, a user thread blocked on a result while the batch this rank needs
# cannot fill makes the rank leave the schedule after this long (at least).
STEADY_BLOCKED_GRACE_S = 0.02
# A step that is one allreduce of one tensor this large (bytes) is not replayed in the steady
# state: negotiated, it is reduced in place; replayed, it would be copied into its batch's buffer
# and back, which costs more than the negotiation saves (measured: a 16 MiB allreduce repeated
# took 3 to 4 ms more of the engine's CPU in the steady state, on 2 ranks of a 2-core machine).
STEADY_LONE_TENSOR_MAX_BYTES = 1 << 20
# A parked rank waits on its doorbell this long at most (a ring always comes first).
PARKED_WAIT_S = 7 * 24 * 3600.0
# In the steady state, how often a rank that has not submitted a batch for the stall check time
# asks the store whether another rank waits for it.
STALL_PROBE_S = 2.0
# How long a survivor waits for the launcher's (or other survivors') account of a failure.
DIAGNOSE_WINDOW_S = 2.0
# A user thread blocked this long on a call still being negotiated is recorded in the store,
# where rank 0 looks for a deadlock (every rank waiting for what another never submits).
WAIT_RECORD_AFTER_S = 1.0
# How often rank 0 reads those records once the negotiation table has stood still long enough.
DEADLOCK_PROBE_S = 1.0
