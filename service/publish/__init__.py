"""The admitted stream republished as vLLM KV events (ZMQ PUB + ROUTER replay): routers
that speak vLLM's KV events see what the fleet's LMCache tiers hold. ``wire.py`` is vLLM's
encoding, ``publisher.py`` the sockets, queue, replay buffer, seq and metrics; what is
published is derived from the directory by ``blendmatch.index.holders``. docs/kv-events.md.
"""

from .publisher import EndpointNotAllowed, KVEventsPublisher, KVEventsSettings, is_bind_endpoint, is_local_endpoint
from .wire import ENCODINGS, END_SEQ, EventEncoder, medium_of, topic_of

__all__ = ["ENCODINGS", "END_SEQ", "EndpointNotAllowed", "EventEncoder", "KVEventsPublisher", "KVEventsSettings",
           "is_bind_endpoint", "is_local_endpoint", "medium_of", "topic_of"]
