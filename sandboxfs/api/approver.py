"""What a `Sandbox` asks about an operation that an approval rule (the config's `approvals:`)
asks about: the caller's approver, bounded in time, its answer made an approvals.Answer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from sandboxfs.core.approval_grants import Answer

# What a sandbox without an approver says of an operation an approval rule asks about.
NO_APPROVER = (
    "this sandbox has no approver: pass approver=callable to Sandbox.open to ask the user, "
    "or change the approvals: rules of the project's sandboxfs.yaml"
)


# The API's approver: a request's description in, an answer out (see Sandbox.open).
Approver = Callable[[dict[str, Any]], "str | bool | None"]


def answering(approver: Approver, timeout: float) -> Callable[[dict[str, Any]], str | None]:
    """`approver` given `timeout` seconds (in a thread of its own, left behind if it hangs),
    its answer as an approvals.Answer value; None (refused) when it fails or is late."""

    def ask(request: dict[str, Any]) -> str | None:
        answers: list[str | bool | None] = []

        def call() -> None:
            with contextlib.suppress(Exception):
                answers.append(approver(request))

        thread = threading.Thread(target=call, name="sandboxfs-approver", daemon=True)
        thread.start()
        thread.join(timeout)
        if not answers:
            return None
        answer = answers[0]
        if answer is True:
            return Answer.ONCE.value
        if isinstance(answer, str) and answer in {a.value for a in Answer}:
            return answer
        return None

    return ask
