"""The stall inspector's deadlock check: every rank waits for a call another never submits."""

from hora.common.engine.negotiation import MessageTable
from hora.common.engine.stall import StallInspector
from hora.common.process_sets import ProcessSetTable
from hora.common.vocabulary.message import Request, RequestType


def _table() -> MessageTable:
    # Rank 0 went on to a barrier; ranks 1 and 2 to the next allgather.
    table = MessageTable(ProcessSetTable(3))
    table.add(0, Request("barrier.noname.0", RequestType.BARRIER))
    for rank in (1, 2):
        table.add(rank, Request("allgather.noname.7", RequestType.ALLGATHER, shape=(1,)))
    return table


def test_every_rank_waiting_on_what_others_never_submit_is_a_deadlock() -> None:
    inspector = StallInspector(60.0, 600.0, True)
    waits = {0: ["barrier.noname.0"], 1: ["allgather.noname.7"]}
    waits[2] = waits[1]
    text = inspector.deadlock(_table(), waits, idle_s=31)
    assert text is not None
    assert "nothing has changed for 31 s" in text
    assert "rank 0 waits for barrier.noname.0, which ranks 1, 2 have not submitted" in text
    assert "rank 2 waits for allgather.noname.7, which rank 0 has not submitted" in text


def test_a_rank_that_waits_for_nothing_in_negotiation_means_no_deadlock() -> None:
    inspector = StallInspector(60.0, 600.0, True)
    # Rank 2 waits for a call that already runs (not in the table): it will move again.
    waits = {0: ["barrier.noname.0"], 1: ["allgather.noname.7"], 2: ["other"]}
    assert inspector.deadlock(_table(), waits, idle_s=31) is None
    # Rank 1 waits for a name of another process set: not the pending one.
    waits = {0: ["barrier.noname.0"], 1: [(1, "allgather.noname.7")], 2: ["x"]}
    assert inspector.deadlock(_table(), waits, idle_s=31) is None
