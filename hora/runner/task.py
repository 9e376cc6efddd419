"""Worker side of ``hora.run``: fetch the function from the store, run it, post the result."""

from __future__ import annotations

import sys
import traceback

import cloudpickle


def main() -> int:
    from hora.common.config import start_timeout_s
    from hora.common.job.store import AuthenticationError, StoreClient
    from hora.common.job.topology import detect
    from hora.runner.api import FUNCTION_KEY, result_key

    topology = detect()
    store = StoreClient(
        topology.rendezvous_addr,
        topology.rendezvous_port,
        topology.secret,
        start_timeout_s(),
    )
    try:
        payload = store.get_signed(FUNCTION_KEY)
    except AuthenticationError as exc:
        print(
            f"hora.run worker (rank {topology.rank}, host {topology.hostname}): {exc}. "
            "The function was not loaded.",
            file=sys.stderr,
        )
        return 1
    fn, args, kwargs = cloudpickle.loads(payload)
    try:
        outcome = ("ok", fn(*args, **kwargs))
        code = 0
    except BaseException as exc:  # reported to the caller with the traceback
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(text, file=sys.stderr, end="")
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{text}")
        code = 1
    try:
        blob = cloudpickle.dumps(outcome)
    except Exception as exc:
        blob = cloudpickle.dumps(("error", f"the result could not be pickled: {exc}"))
        code = 1
    store.set_signed(result_key(topology.rank), blob)
    try:
        from hora.common.lifecycle import shutdown

        shutdown()
    except Exception:  # the result is already posted
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
