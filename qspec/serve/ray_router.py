"""Ray Serve's request router for ``qspec serve --replicas N``: a conversation stays on one replica.

A replica keeps a finished request's KV for the conversation's next turn (prefix reuse), so the next
turn should reach the same replica. Ray Serve routes an HTTP request before its body arrives (the
proxy streams the body to the chosen replica), so the router cannot read the prompt; it reads the
request's headers. A request with an ``x-session-id`` header goes to the replica its value hashes
to (rendezvous hashing over the running replicas: a replica that leaves or joins moves only the
conversations it held or takes); that replica's queue being full, to the next in the key's order.
Requests without the header keep Ray Serve's own policy (the shorter queue of two random replicas).

Imported by Ray Serve in its proxy and handles (``request_router_config``), never by ``qspec serve``
itself: ``--replicas 1`` imports no Ray.

>>> rank_for("chat-42", ["a", "b", "c"]) == rank_for("chat-42", ["c", "b", "a"])
True
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Ray Serve's default router

SESSION_HEADER = b"x-session-id"


def rank_for(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` in ``key``'s order of preference: highest ``sha256(key, replica)`` first."""
    return sorted(replicas, key=lambda r: hashlib.sha256(f"{key}\0{r}".encode()).digest(), reverse=True)


def session_key(pending_request) -> str | None:
    """The ``x-session-id`` header of a request from Ray Serve's HTTP proxy (its argument: the pickled request
    with the ASGI scope), None for any other request."""
    args = getattr(pending_request, "args", None) or []
    if not args or not isinstance(args[0], bytes):
        return None
    try:
        scope = pickle.loads(args[0]).asgi_scope
    except Exception:  # not the proxy's request object
        return None
    for name, value in scope.get("headers", []):
        if name.lower() == SESSION_HEADER:
            return value.decode("latin-1")
    return None


class ConversationRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's router, with requests that name their conversation sent to that conversation's replica."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        key = session_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        ranked = [by_id[r] for r in rank_for(key, list(by_id))]
        return [ranked[:1], ranked[1:]]
